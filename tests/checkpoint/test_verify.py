"""`dmt ckpt verify` finds each injected fault and names the file; `inspect` describes what is there."""

import json

import pytest
import torch

from toolkit.checkpoint.manifest import point_latest, resolve_latest, write_manifest
from toolkit.cli.main import main

pytestmark = pytest.mark.launch  # uses the real DeepSpeed checkpoints of conftest.py

RANK1 = "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _verify(capsys, path, *flags):
    code = main(["ckpt", "verify", str(path), "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def test_clean_checkpoints_verify_and_inspect(zero_checkpoints, capsys):
    for ckpt in zero_checkpoints.values():
        code, report = _verify(capsys, ckpt, "--deep")
        assert code == 0 and report["ok"] and report["format"] == "deepspeed-zero" and report["tensors_checked"] > 0
    assert main(["ckpt", "inspect", str(zero_checkpoints["zero3"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["zero_stage"] == 3 and info["world_size"] == 2 and info["optimizer_state"] and info["parameters"] > 0


def test_deleted_rank_file(zero3_copy, capsys):
    (zero3_copy / RANK1).unlink()
    code, report = _verify(capsys, zero3_copy)
    assert code == 1 and any("rank 1 is missing" in p["problem"] for p in report["problems"])


def test_truncated_shard_without_manifest(zero3_copy, capsys):
    shard = zero3_copy / RANK1
    shard.write_bytes(shard.read_bytes()[:-4096])
    code, report = _verify(capsys, zero3_copy)
    assert code == 1 and report["problems"][0]["file"] == str(shard)


def test_flipped_bytes_and_manifest_mismatch_are_caught_by_the_manifest(zero3_copy, capsys):
    write_manifest(zero3_copy, step=2, world_size=2, layout={"zero": 3}, fmt="deepspeed-zero")
    assert _verify(capsys, zero3_copy)[0] == 0
    shard = zero3_copy / RANK1
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the checksum can tell
    shard.write_bytes(bytes(data))
    code, report = _verify(capsys, zero3_copy)
    assert code == 1 and {"file": str(shard), "problem": "sha256 differs from the manifest (bytes changed)"} in report["problems"]
    manifest_path = zero3_copy / "dmt_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    other = "global_step2/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    manifest["files"][other]["bytes"] += 1
    manifest_path.write_text(json.dumps(manifest))
    code, report = _verify(capsys, zero3_copy)
    assert any(p["file"] == str(zero3_copy / other) and "manifest says" in p["problem"] for p in report["problems"])


def test_nan_in_a_weight_needs_deep(zero3_copy, capsys):
    shard = zero3_copy / RANK1
    state = torch.load(shard, map_location="cpu", weights_only=False)
    with torch.no_grad():
        state["optimizer_state_dict"]["fp32_flat_groups"][0][5] = float("nan")
    torch.save(state, shard)
    capsys.readouterr()  # unpickling imported deepspeed, whose logger prints to stdout
    assert _verify(capsys, zero3_copy)[0] == 0  # structure is sound
    code, report = _verify(capsys, zero3_copy, "--deep")
    assert code == 1 and "NaN/Inf" in report["problems"][0]["problem"]


def test_nan_in_converted_safetensors(zero_checkpoints, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "hf"
    assert main(["convert", "zero-to-hf", str(zero_checkpoints["zero2"]), str(out)]) == 0
    capsys.readouterr()
    assert _verify(capsys, out, "--deep")[0] == 0
    weights = load_file(str(out / "model.safetensors"))
    weights["model.norm.weight"][0] = float("inf")
    save_file(weights, str(out / "model.safetensors"))
    code, report = _verify(capsys, out, "--deep")
    assert code == 1 and "model.norm.weight" in report["problems"][0]["problem"]


def test_latest_moves_only_to_a_checkpoint_with_a_manifest(tmp_path):
    first, second = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    for ckpt in (first, second):
        ckpt.mkdir()
        (ckpt / "weights.bin").write_bytes(b"x" * 10)
    write_manifest(first, step=1, world_size=1, layout={}, fmt="test")
    point_latest(tmp_path, first)
    with pytest.raises(ValueError):
        point_latest(tmp_path, second)  # a save that died before its manifest never becomes latest
    assert resolve_latest(tmp_path) == first


def _poison(rank_file, key_suffix: str, index: int = 7) -> str:
    """Write a NaN into element `index` of the tensor whose key ends with `key_suffix`, in place (the file's bytes
    otherwise unchanged); returns the full key."""
    import struct

    from toolkit.checkpoint.finite import lazy_tensors
    from toolkit.checkpoint.torch_zip import index_torch_file

    key, lazy = next((k, t) for k, t in lazy_tensors(index_torch_file(rank_file), "") if k.endswith(key_suffix))
    with open(rank_file, "r+b") as handle:
        handle.seek(lazy.offset + 4 * index)
        handle.write(struct.pack("<f", float("nan")))
    return key


@pytest.mark.parametrize("name", ["zero1-tied", "zero2", "zero3"])
@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_deep_scans_the_optimizer_state_not_only_the_weights(zero_copy, capsys, name, moment):
    """Adam's second moment gone NaN: the weights are finite today and NaN after the next step of a resumed run."""
    ckpt = zero_copy(name)
    rank_file = ckpt / RANK1
    key = _poison(rank_file, f"state.0.{moment}")
    code, report = _verify(capsys, ckpt, "--deep")
    assert code == 1 and report["problems"] == [{"file": str(rank_file), "problem": f"{key} holds 1 NaN/Inf values"}]


def test_piped_output_keeps_whole_values(zero3_copy):
    """`dmt ckpt verify DIR | cat` and `| grep`: the damaged file's name is the one thing the reader is after."""
    import subprocess
    import sys

    def piped(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "toolkit", "ckpt", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=120)

    inspect = piped("inspect", str(zero3_copy))
    assert inspect.returncode == 0 and f"path             {zero3_copy}\n" in inspect.stdout, inspect.stdout
    shard = zero3_copy / RANK1
    shard.write_bytes(shard.read_bytes()[:-4096])
    verify = piped("verify", str(zero3_copy))
    assert verify.returncode == 1 and "…" not in verify.stdout, verify.stdout
    assert verify.stdout.splitlines()[1].startswith(f"{shard}: "), verify.stdout
