"""The checkpoint verbs on inputs they cannot read and outputs they cannot write: one line naming the file or flag
and exit 2 (or a verify report naming the damaged file, exit 1), nothing the user had changed, nothing left behind.
Everything here is built in the test from a few tensors: no training launch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_llama_config
from toolkit.checkpoint import atomic
from toolkit.cli.main import main


def _hf_dir(root: Path, tensors: dict | None = None, **config) -> Path:
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(tiny_llama_config(**config)))
    save_file(tensors or {"model.norm.weight": torch.ones(4)}, root / "model.safetensors")
    return root


def _verify(capsys, path, *flags) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["ckpt", "verify", str(path), "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def _dcp(root: Path, state: dict) -> Path:
    """A torch.distributed.checkpoint directory as Megatron-Core's torch_dist saver writes it: metadata.json beside,
    and an object (io.BytesIO) stored as its bytes, a torch.save archive (DCP's default planner would pickle the
    BytesIO itself)."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class ObjectBytesAsTheyAre(DefaultSavePlanner):
        def transform_object(self, write_item, value):
            return value if isinstance(value, io.BytesIO) else super().transform_object(write_item, value)

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root)), planner=ObjectBytesAsTheyAre(), no_dist=True)
    (root / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    return root


def _safetensors_bytes(header: bytes, data: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + data


@pytest.mark.parametrize("content", [
    os.urandom(4096),  # random bytes: the header length is absurd
    _safetensors_bytes(b"{not json}      "),
    _safetensors_bytes(b"[1, 2]  "),
    _safetensors_bytes(b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', b"\0" * 8),  # truncated
    _safetensors_bytes(b'{"w": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}', b"\0" * 16),
], ids=["random bytes", "header not JSON", "header a list", "data truncated", "shape a string"])
def test_a_damaged_safetensors_file_is_named(tmp_path, refused, capsys, content):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(content)
    refused(["ckpt", "inspect", weights], str(weights), "expected a safetensors file")
    code, report = _verify(capsys, weights)
    assert code == 1 and report["problems"][0]["file"] == str(weights), report


def test_a_damaged_dcp_metadata_is_named(tmp_path, refused, capsys):
    ckpt = _dcp(tmp_path / "dcp", {"w": torch.ones(4)})
    (ckpt / ".metadata").write_bytes(bytes(range(256)) + b"\x80\x04" + bytes(42))  # fixed bytes: not a pickle
    refused(["ckpt", "inspect", ckpt], str(ckpt / ".metadata"), "expected torch.distributed.checkpoint metadata")
    code, report = _verify(capsys, ckpt)
    assert code == 1 and report["problems"][0]["file"] == str(ckpt / ".metadata")
    refused(["convert", "megatron-to-hf", ckpt, tmp_path / "out", "--config", _hf_dir(tmp_path / "hf")],
            "MEGATRON_DIR", str(ckpt / ".metadata"))


@pytest.mark.parametrize("manifest", ["garbage{", "[1, 2]", '{"files": [1]}', '{"files": {"model.safetensors": 3}}',
                                      '{"files": {"../../etc/passwd": {"bytes": 1, "sha256": "x"}}}'])
def test_a_damaged_manifest_is_a_problem_of_verify_and_a_refusal_of_inspect(tmp_path, refused, capsys, manifest):
    model = _hf_dir(tmp_path / "hf")
    (model / "dmt_manifest.json").write_text(manifest)
    code, report = _verify(capsys, model)
    assert code == 1 and [p["file"] for p in report["problems"]] == [str(model / "dmt_manifest.json")], report
    refused(["ckpt", "inspect", model], str(model / "dmt_manifest.json"), "expected a dmt manifest")


@pytest.mark.parametrize("config, says", [([1, 2], "holds a list"), ({"hidden_size": 64}, "has no model_type"),
                                          ("{", "is not valid JSON")])
def test_an_unreadable_hf_config_names_the_file_not_a_model_key(tmp_path, refused, config, says):
    model = _hf_dir(tmp_path / "hf")
    (model / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    refused(["convert", "hf-to-megatron", model, tmp_path / "out"], "HF_DIR", str(model / "config.json"), says)
    refused(["convert", "check", model, tmp_path], "HF_DIR", says)


def test_verify_deep_reads_every_safetensors_file(tmp_path, capsys):
    from safetensors.torch import save_file

    model = tmp_path / "hf"
    model.mkdir()
    save_file({"a": torch.ones(4)}, model / "model-00001-of-00002.safetensors")
    save_file({"b": torch.tensor([1.0, float("nan")])}, model / "model-00002-of-00002.safetensors")
    code, report = _verify(capsys, model, "--deep")
    assert code == 1 and report["tensors_checked"] == 2, report
    assert report["problems"] == [{"file": str(model / "model-00002-of-00002.safetensors"),
                                   "problem": "tensor b holds 1 NaN/Inf values"}]


def test_verify_deep_reads_tensors_inside_stored_objects(tmp_path, capsys):
    """Megatron-Core's distributed optimizer (dp_reshardable, Megatron-LM's default) stores its fp32 partitions and
    Adam moments as objects, each a torch.save of tensors, not as checkpoint tensors."""
    import io

    buffer = io.BytesIO()
    torch.save([{"exp_avg_sq": torch.tensor([1.0, float("inf")])}], buffer)  # Megatron saves [object]
    buffer.seek(0)
    ckpt = _dcp(tmp_path / "dcp", {"decoder.weight": torch.ones(4), "optimizer.param_state": buffer})
    code, report = _verify(capsys, ckpt, "--deep")
    assert code == 1 and len(report["problems"]) == 1, report
    assert "optimizer.param_state.0.exp_avg_sq holds 1 NaN/Inf" in report["problems"][0]["problem"]


def test_inspect_of_a_file_reports_the_files_size(tmp_path, capsys):
    model = _hf_dir(tmp_path / "hf", {"w": torch.ones(8, 8)})
    (model / "big.bin").write_bytes(bytes(1 << 20))
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(model / "model.safetensors"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bytes"] == (model / "model.safetensors").stat().st_size and info["parameters"] == 64


def test_hf_to_megatron_refuses_quantized_weights_in_one_line(tmp_path, refused):
    hf = _hf_dir(tmp_path / "hf", model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    refused(["convert", "hf-to-megatron", hf, tmp_path / "out"], "HF_DIR", "quantization_config 'fp8'")


def _out_paths(tmp_path: Path, hf: Path) -> dict[str, tuple[Path, str]]:
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    return {"an existing file": (afile, "is an existing file"),
            "a path under a file": (afile / "sub" / "out", "which is a file"),
            "an unwritable place": (Path("/sys/dmt-cannot-write-here/out"), "cannot be created"),
            "the input itself": (hf, "is one of the inputs"),
            "a file of the input": (hf / "config.json", "is an existing file")}


@pytest.mark.parametrize("case", ["an existing file", "a path under a file", "an unwritable place", "the input itself",
                                  "a file of the input"])
def test_hf_to_megatron_refuses_an_output_it_cannot_make(tmp_path, refused, case):
    hf = _hf_dir(tmp_path / "hf", model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    out, says = _out_paths(tmp_path, hf)[case]
    refused(["convert", "hf-to-megatron", hf, out], "OUT_DIR", str(out), says)


def test_a_killed_writers_temp_directory_is_removed_by_the_next_run_and_a_live_ones_kept(tmp_path, caplog):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".out.tmp-{finished.stdout.strip()}"  # the name an earlier version gave it: no host
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "model.safetensors").write_bytes(bytes(3 << 20))
    alive = tmp_path / f".out.tmp-{os.getppid()}"
    other_host = tmp_path / f".out.tmp-{finished.stdout.strip()}@another-node"
    for kept in (alive, other_host):
        kept.mkdir()
    with caplog.at_level("WARNING", logger=atomic.__name__), atomic.atomic_directory(tmp_path / "out") as tmp:
        (tmp / "x").write_text("done")
    assert not dead.exists() and alive.is_dir() and other_host.is_dir() and (tmp_path / "out" / "x").is_file()
    assert [r.getMessage() for r in caplog.records] == [
        f"removed {dead} (3.0 MiB), left by process {dead.name.split('-')[-1]}, which no longer runs (an "
        f"interrupted conversion)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other_host.name, "out"])
