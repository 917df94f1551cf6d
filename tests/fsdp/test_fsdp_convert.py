"""`dmt convert fsdp-to-hf` on the checkpoint the accelerate launch saved: the same tensors, bit for bit, as
`accelerate merge-weights` writes; shards by --max-shard-size; loads with from_pretrained. The same for the tiny
Mixtral's checkpoint (its experts under transformers' names). `dmt ckpt verify` names a damaged shard, with or without
the manifest; `dmt ckpt inspect` describes the checkpoint."""

import json
import shutil
import subprocess

import pytest
from fsdp_helpers import BIN, MOE_STEPS, STEPS, environment

from helpers import safetensors_tensors

pytestmark = pytest.mark.launch


@pytest.fixture(scope="module")
def checkpoint(accelerate_run):
    return accelerate_run.out / f"checkpoint-{STEPS}"


def _dmt(capsys, *argv: str) -> tuple[int, str, str]:
    from toolkit.cli.main import main

    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_conversion_equals_accelerate_merge_weights_bit_for_bit(checkpoint, tmp_path, capsys):
    code, out, _ = _dmt(capsys, "convert", "fsdp-to-hf", str(checkpoint), str(tmp_path / "hf"), "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["rank_files"] == 2 and summary["shards"] == 1 and summary["parameters"] == 158016
    merged = subprocess.run([str(BIN / "accelerate"), "merge-weights", str(checkpoint / "pytorch_model_fsdp_0"),
                             str(tmp_path / "merged")], capture_output=True, text=True, env=environment(), timeout=300)
    assert merged.returncode == 0, merged.stderr[-2000:]
    ours, theirs = safetensors_tensors(tmp_path / "hf"), safetensors_tensors(tmp_path / "merged")
    assert sorted(ours) == sorted(theirs) and len(ours) == 21
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert ours[name].numpy().tobytes() == tensor.numpy().tobytes(), name


def test_moe_conversion_equals_accelerates_merge_and_loads(moe_reshard, tmp_path, capsys):
    """The tiny Mixtral's 2-rank checkpoint: Accelerate's merge_fsdp_weights and fsdp-to-hf give the same tensors,
    the fused expert ones included; from_pretrained takes them as they are."""
    import torch
    from accelerate.utils import merge_fsdp_weights
    from transformers import AutoModelForCausalLM

    workdir, _ = moe_reshard
    checkpoint = workdir / "reference" / f"checkpoint-{MOE_STEPS}"
    code, out, _ = _dmt(capsys, "convert", "fsdp-to-hf", str(checkpoint), str(tmp_path / "hf"), "--json")
    assert code == 0 and json.loads(out)["rank_files"] == 2
    merge_fsdp_weights(str(checkpoint / "pytorch_model_fsdp_0"), str(tmp_path / "merged"), safe_serialization=True)
    ours, theirs = safetensors_tensors(tmp_path / "hf"), safetensors_tensors(tmp_path / "merged")
    assert sorted(ours) == sorted(theirs) and sum(".mlp.experts." in name for name in ours) == 4, sorted(ours)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert ours[name].numpy().tobytes() == tensor.numpy().tobytes(), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    assert sorted(loaded) == sorted(ours) and all(torch.equal(loaded[k], ours[k]) for k in ours)


def test_sharded_output_loads_with_from_pretrained(checkpoint, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    code, _, _ = _dmt(capsys, "convert", "fsdp-to-hf", str(checkpoint), str(tmp_path / "hf"), "--max-shard-size",
                      "200KB", "--dtype", "bf16")
    assert code == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, safetensors_tensors(tmp_path / "hf")["lm_head.weight"])


def test_verify_names_a_damaged_shard(checkpoint, tmp_path, capsys):
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    shard = copy / "pytorch_model_fsdp_0" / "__1_0.distcp"
    with open(shard, "r+b") as handle:  # same size, other bytes: only the manifest's sha256 can tell
        handle.seek(shard.stat().st_size // 2)
        handle.write(b"\xff" * 32)
    code, out, _ = _dmt(capsys, "ckpt", "verify", str(copy), "--json")
    report = json.loads(out)
    assert code == 1 and [p["file"] for p in report["problems"]] == [str(shard)]
    (copy / "dmt_manifest.json").unlink()
    optimizer_shard = copy / "optimizer_0" / "__0_0.distcp"
    with open(optimizer_shard, "r+b") as handle:
        handle.truncate(1000)
    code, out, _ = _dmt(capsys, "ckpt", "verify", str(copy), "--json")
    report = json.loads(out)
    assert code == 1 and report["problems"][0]["file"] == str(optimizer_shard)
    assert "truncated" in report["problems"][0]["problem"]


def test_converting_a_truncated_shard_names_it(checkpoint, tmp_path, capsys):
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    shard = copy / "pytorch_model_fsdp_0" / "__1_0.distcp"
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    code, _, err = _dmt(capsys, "convert", "fsdp-to-hf", str(copy), str(tmp_path / "hf"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and str(shard) in err, err
    assert not (tmp_path / "hf").exists()  # nothing half-written under the final name


def test_inspect_describes_the_checkpoint(checkpoint, capsys):
    code, out, _ = _dmt(capsys, "ckpt", "inspect", str(checkpoint), "--json")
    info = json.loads(out)
    assert code == 0 and info["format"] == "hf-trainer+fsdp" and info["step"] == STEPS
    assert info["parameters"] == 158016 and info["optimizer_state"] is True and info["rank_files"] == 2
    assert info["layout"]["dp_shard"] == 2
