"""`dmt convert zero-to-hf` on checkpoints written by real 2-rank DeepSpeed runs: bitwise equal to zero_to_fp32, for
the tiny Llama at each ZeRO stage and for the MoE families at ZeRO-3 (transformers' fused expert tensors, DeepSeek-V3's
routing-bias buffer, GPT-OSS's expert biases and attention sinks; Qwen3-MoE's: tests/training/test_train_launch.py)."""

import json
from pathlib import Path

import pytest
import torch

from helpers import MOE_SAVED, TINY_MOE
from toolkit.backends.deepspeed.convert import convert_zero_to_hf
from toolkit.cli.main import main

pytestmark = pytest.mark.launch


def _reference(ckpt) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {k: v.contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(ckpt)).items()}


@pytest.mark.parametrize("name", ["zero1-tied", "zero2", "zero3", *(f"zero3-{family}" for family in MOE_SAVED)])
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
    family = TINY_MOE.get(name.removeprefix("zero3-"))
    if family is not None:  # the fused experts, gate_up_proj and down_proj per layer, under the model's own names
        assert sum(".mlp.experts." in key for key in seen) >= 2 * family["num_hidden_layers"], sorted(seen)
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
        convert_zero_to_hf(zero_checkpoints["zero3"], out, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_the_fp32_path_copies_bytes_without_importing_torch(zero_checkpoints, tmp_path):
    # what makes it ~5x faster than zero_to_fp32 (benchmarks/zero_to_hf_speed.md): torch's import alone costs ~1.5 s
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from toolkit.backends.deepspeed.convert import convert_zero_to_hf; "
            "convert_zero_to_hf(Path(sys.argv[1]), Path(sys.argv[2]), progress=False); "
            "print('torch' in sys.modules)")
    out = tmp_path / "hf"
    result = subprocess.run([sys.executable, "-c", code, str(zero_checkpoints["zero3"]), str(out)],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", result.stderr
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("damaged", ["global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                     "global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt", "config.json"])
def test_a_checkpoint_whose_bytes_changed_since_its_manifest_is_refused(zero3_copy, tmp_path, refused, damaged):
    from toolkit.checkpoint.manifest import write_manifest

    write_manifest(zero3_copy, step=2, world_size=2, layout={"zero": 3}, fmt="deepspeed-zero")
    file = zero3_copy / damaged
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
    file.write_bytes(bytes(data))
    refused(["convert", "zero-to-hf", zero3_copy, tmp_path / "out"], str(file), "sha256 differs from the manifest")
    file.write_bytes(bytes(data[:-8]))
    refused(["convert", "zero-to-hf", zero3_copy / "global_step2", tmp_path / "out"], str(file), "manifest says")


def _other_models() -> dict:
    from helpers import tiny_llama_config

    return {"a wider llama": (tiny_llama_config(), "model.embed_tokens.weight"),
            "a gpt2": ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 301},
                       "which the gpt2 model"),
            "a deeper llama": (tiny_llama_config(hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                                 num_key_value_heads=2, vocab_size=301), "model.layers.2.")}


@pytest.mark.parametrize("other", ["a wider llama", "a gpt2", "a deeper llama"])
def test_a_config_of_another_model_is_refused_before_writing(zero_checkpoints, tmp_path, refused, other):
    config, says = _other_models()[other]
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused(["convert", "zero-to-hf", zero_checkpoints["zero2"], tmp_path / "out", "--config", tmp_path / "config.json"],
            "--config", says)


def test_a_parent_directorys_config_is_checked_like_a_given_one(zero_copy, tmp_path, refused):
    ckpt = zero_copy("zero2")
    (ckpt / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(_other_models()["a wider llama"][0]))
    refused(["convert", "zero-to-hf", ckpt, tmp_path / "out"], str(tmp_path / "config.json"), "embed_tokens")


@pytest.mark.parametrize("config, says", [([1], "holds a list"), ({"hidden_size": 64}, "has no model_type")])
def test_an_unreadable_config_names_it(zero_checkpoints, tmp_path, refused, config, says):
    (tmp_path / "c.json").write_text(json.dumps(config))
    refused(["convert", "zero-to-hf", zero_checkpoints["zero2"], tmp_path / "out", "--config", tmp_path / "c.json"],
            "--config", says)


@pytest.mark.parametrize("case", ["an existing file", "a path under a file", "an unwritable place", "the input itself",
                                  "the config given"])
def test_an_output_it_cannot_make_is_refused(zero_copy, tmp_path, refused, case):
    ckpt = zero_copy("zero2")
    (tmp_path / "notes.txt").write_text("mine")
    out, says = {"an existing file": (tmp_path / "notes.txt", "is an existing file"),
                 "a path under a file": (tmp_path / "notes.txt" / "out", "which is a file"),
                 "an unwritable place": (Path("/sys/dmt-cannot-write-here/out"), "cannot be created"),
                 "the input itself": (ckpt, "is one of the inputs"),
                 "the config given": (ckpt / "config.json", "is one of the inputs")}[case]
    refused(["convert", "zero-to-hf", ckpt, out, "--config", ckpt / "config.json"], "OUT_DIR", str(out), says)
