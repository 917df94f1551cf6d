"""`dmt convert zero-to-hf` on checkpoints written by real 2-rank DeepSpeed runs: bitwise equal to zero_to_fp32."""

import json

import pytest
import torch

from toolkit.checkpoint import zero_to_hf
from toolkit.cli.main import main

pytestmark = pytest.mark.launch


def _reference(ckpt) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {k: v.contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(ckpt)).items()}


@pytest.mark.parametrize("name", ["zero1-tied", "zero2", "zero3"])
def test_conversion_equals_deepspeeds_zero_to_fp32_and_loads(zero_checkpoints, tmp_path, capsys, name):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ckpt = zero_checkpoints[name]
    out = tmp_path / "hf"
    assert main(["convert", "zero-to-hf", str(ckpt), str(out), "--max-shard-size", "100KB", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["world_size"] == 2 and summary["shards"] > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    reference = _reference(ckpt)
    seen = set()
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / shard), framework="pt") as handle:
            for key in handle.keys():
                assert torch.equal(handle.get_tensor(key), reference[key]), key
                seen.add(key)
    tied_alias = {"lm_head.weight"} if name.endswith("tied") else set()
    assert seen == set(reference) - tied_alias
    model = AutoModelForCausalLM.from_pretrained(out)
    for key, value in model.state_dict().items():
        assert torch.equal(value, reference[key]), key
    ids = torch.arange(16).unsqueeze(0)
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_bf16_output_is_the_cast_of_the_fp32_one(zero_checkpoints, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    assert main(["convert", "zero-to-hf", str(zero_checkpoints["zero2"]), str(out), "--dtype", "bf16"]) == 0
    weights = load_file(str(out / "model.safetensors"))
    reference = _reference(zero_checkpoints["zero2"])
    assert all(weights[k].dtype == torch.bfloat16 and torch.equal(weights[k], reference[k].bfloat16()) for k in weights)


def test_missing_rank_file_is_named(zero3_copy, tmp_path, capsys):
    (zero3_copy / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert main(["convert", "zero-to-hf", str(zero3_copy), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "rank 1 is missing" in err and not (tmp_path / "out").exists()


def test_truncated_shard_is_named(zero3_copy, tmp_path, capsys):
    shard = zero3_copy / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert main(["convert", "zero-to-hf", str(zero3_copy), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(shard) in err and "corrupt" in err


def test_wrong_tag_lists_the_tags_present(zero_checkpoints, tmp_path, capsys):
    assert main(["convert", "zero-to-hf", str(zero_checkpoints["zero2"]), str(tmp_path / "o"), "--tag", "global_step9"]) == 2
    assert "global_step2" in capsys.readouterr().err


def test_interrupted_conversion_leaves_no_output(zero_checkpoints, tmp_path, monkeypatch):
    calls = {"n": 0}
    from toolkit.checkpoint.safetensors_stream import StreamingSafetensorsWriter

    original = StreamingSafetensorsWriter.copy_ranges

    def failing_copy(self, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C in the middle of the third tensor
        return original(self, *args)

    monkeypatch.setattr(StreamingSafetensorsWriter, "copy_ranges", failing_copy)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        zero_to_hf.convert_zero_to_hf(zero_checkpoints["zero3"], out, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_the_fp32_path_copies_bytes_without_importing_torch(zero_checkpoints, tmp_path):
    # what makes it ~5x faster than zero_to_fp32 (benchmarks/zero_to_hf_speed.md): torch's import alone costs ~1.5 s
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from toolkit.checkpoint.zero_to_hf import convert_zero_to_hf; "
            "convert_zero_to_hf(Path(sys.argv[1]), Path(sys.argv[2]), progress=False); "
            "print('torch' in sys.modules)")
    out = tmp_path / "hf"
    result = subprocess.run([sys.executable, "-c", code, str(zero_checkpoints["zero3"]), str(out)],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", result.stderr
    assert (out / "model.safetensors").is_file()
