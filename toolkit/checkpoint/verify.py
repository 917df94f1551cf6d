"""`dmt ckpt verify` / `inspect`: detect a checkpoint's format, check it is complete and intact, describe it.

Formats: DeepSpeed ZeRO (a tag directory or a directory with `latest`), HF Trainer (checkpoint-N with
trainer_state.json, weights as safetensors, a DeepSpeed tag or FSDP2's DCP directories pytorch_model_fsdp_0/ and
optimizer_0/), Megatron-Core dist checkpoints (metadata.json + *.distcp, torch.distributed.checkpoint), a bare DCP
directory (.metadata + *.distcp), HF safetensors (model.safetensors or an index). With a manifest, every listed file
must exist with its size and sha256; without one, every file must open and shards must agree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.checkpoint.manifest import MANIFEST, read_manifest, sha256_file
from toolkit.errors import UserInputError


@dataclass
class VerifyReport:
    path: str
    format: str
    ok: bool = True
    problems: list[dict] = field(default_factory=list)  # {"file": ..., "problem": ...}
    files_checked: int = 0
    tensors_checked: int = 0
    manifest: bool = False

    def problem(self, file: Path | str, text: str) -> None:
        self.ok = False
        self.problems.append({"file": str(file), "problem": text})

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def detect_format(path: Path) -> str:
    if not path.exists():
        raise UserInputError("PATH", f"{path} does not exist")
    if path.is_file():
        return "hf-safetensors" if path.suffix == ".safetensors" else "unknown"
    if (path / "metadata.json").is_file() and any(path.glob("*.distcp")):
        return "megatron-dist"
    if (path / ".metadata").is_file() and any(path.glob("*.distcp")):
        return "dcp"
    if (path / "trainer_state.json").is_file():
        return "hf-trainer"
    if any(path.glob("*_optim_states.pt")) or ((path / "latest").is_file() and (path / (path / "latest").read_text().strip()).is_dir()
                                               and any((path / (path / "latest").read_text().strip()).glob("*_optim_states.pt"))):
        return "deepspeed-zero"
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return "hf-safetensors"
    raise UserInputError("PATH", f"{path}: no known checkpoint format (DeepSpeed ZeRO, HF Trainer, Megatron dist, HF safetensors)")


def verify(path: Path, deep: bool = False) -> VerifyReport:
    fmt = detect_format(path)
    report = VerifyReport(path=str(path), format="hf-trainer+fsdp" if fmt == "hf-trainer" and fsdp_dirs(path) else fmt)
    root = path if path.is_dir() else path.parent
    manifest = read_manifest(root) if path.is_dir() else None
    if manifest is not None:
        report.manifest = True
        _check_manifest(root, manifest, report)
    if fmt == "deepspeed-zero":
        _check_zero(path, report, deep)
    elif fmt == "hf-trainer":
        _check_hf_trainer(path, report, deep)
    elif fmt in ("megatron-dist", "dcp"):
        _check_dcp(path, report, deep)
    else:
        _check_safetensors(path, report, deep)
    return report


def _check_manifest(root: Path, manifest: dict, report: VerifyReport) -> None:
    for rel, expected in manifest.get("files", {}).items():
        file = root / rel
        if not file.is_file():
            report.problem(file, "listed in the manifest but missing")
            continue
        report.files_checked += 1
        size = file.stat().st_size
        if size != expected["bytes"]:
            report.problem(file, f"size {size} bytes, manifest says {expected['bytes']} (truncated or replaced)")
        elif sha256_file(file) != expected["sha256"]:
            report.problem(file, "sha256 differs from the manifest (bytes changed)")


def _check_zero(path: Path, report: VerifyReport, deep: bool) -> None:
    from toolkit.checkpoint.deepspeed_zero import open_zero_checkpoint

    try:
        checkpoint = open_zero_checkpoint(path)
    except UserInputError as exc:
        report.problem(exc.key, exc.message)
        return
    report.files_checked = max(report.files_checked, len(list(checkpoint.tag_dir.iterdir())))
    if deep:
        _check_finite(checkpoint.tensors(), checkpoint.tag_dir, report)


def _check_hf_trainer(path: Path, report: VerifyReport, deep: bool) -> None:
    try:
        json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        report.problem(path / "trainer_state.json", f"unreadable ({exc})")
    tags = [p for p in path.iterdir() if p.is_dir() and any(p.glob("*_optim_states.pt"))]
    if tags:
        _check_zero(path, report, deep)
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        _check_safetensors(path, report, deep)
    sharded = fsdp_dirs(path)  # FSDP2 (Accelerate's SHARDED_STATE_DICT): one DCP directory each for model, optimizer
    for directory in sharded:
        _check_dcp(directory, report, deep)
    if not tags and not sharded and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        report.problem(path, "HF Trainer checkpoint without model weights")


def _safetensors_files(path: Path, report: VerifyReport) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            report.problem(index, f"unreadable index ({exc})")
            return []
        files = sorted({path / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                report.problem(file, "named in model.safetensors.index.json but missing")
        return [f for f in files if f.is_file()]
    return [path / "model.safetensors"]


def _check_safetensors(path: Path, report: VerifyReport, deep: bool) -> None:
    from safetensors import safe_open

    for file in _safetensors_files(path, report):
        try:
            with safe_open(str(file), framework="pt") as handle:
                report.files_checked += 1
                if deep:
                    _check_finite(((k, handle.get_tensor(k)) for k in handle.keys()), file, report)
        except Exception as exc:  # safetensors raises its own error types for bad headers / short files
            report.problem(file, f"cannot be opened as safetensors ({type(exc).__name__}: {exc})")


def fsdp_dirs(path: Path) -> list[Path]:
    """The DCP directories Accelerate's FSDP saving writes into a Trainer checkpoint (pytorch_model_fsdp_0,
    optimizer_0)."""
    return sorted(p for p in path.glob("*_0") if p.is_dir() and (p / ".metadata").is_file()
                  and p.name.split("_")[0] in ("pytorch", "optimizer"))


def _check_dcp(path: Path, report: VerifyReport, deep: bool) -> None:
    """A torch DCP directory: metadata readable, every storage file it names present and long enough."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        report.problem(path / ".metadata", f"unreadable dist-checkpoint metadata ({type(exc).__name__}: {exc})")
        return
    needed = {info.relative_path for info in metadata.storage_data.values()}
    for rel in sorted(needed):
        file = path / rel
        if not file.is_file():
            report.problem(file, "storage file named by the checkpoint metadata is missing")
        else:
            report.files_checked += 1
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in ends.items():
        file = path / rel
        if file.is_file() and file.stat().st_size < end:
            report.problem(file, f"{file.stat().st_size} bytes, metadata needs {end} (truncated)")
    if deep and report.ok:
        _check_dcp_tensors(path, metadata, report)


def _check_dcp_tensors(path: Path, metadata, report: VerifyReport) -> None:
    """Every floating tensor read chunk by chunk; a chunk that does not load names its file."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from toolkit.checkpoint.megatron_stream import DistCheckpointReader

    reader = DistCheckpointReader(path, key="PATH")
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or not meta.properties.dtype.is_floating_point:
            continue
        try:
            tensor = reader.read(key, (0,) * len(meta.size), tuple(meta.size))
        except UserInputError as exc:
            report.problem(exc.message.split(":")[0], exc.message.split(": ", 1)[-1])
            continue
        _check_finite([(key, tensor)], path, report)


def _check_finite(tensors, where: Path, report: VerifyReport) -> None:
    import torch

    for name, tensor in tensors:
        report.tensors_checked += 1
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            report.problem(where, f"tensor {name} holds {bad} NaN/Inf values")


def inspect(path: Path) -> dict:
    """What is in a checkpoint: format, step, layout, parameters, optimizer state, dtypes, size."""
    fmt = detect_format(path)
    root = path if path.is_dir() else path.parent
    info: dict = {"path": str(path), "format": fmt, "bytes": sum(f.stat().st_size for f in root.rglob("*") if f.is_file())}
    manifest = read_manifest(root)
    if manifest:
        info.update(step=manifest.get("step"), world_size=manifest.get("world_size"), layout=manifest.get("layout"))
    if fmt in ("deepspeed-zero", "hf-trainer") and (any(root.glob("*/*_optim_states.pt")) or any(root.glob("*_optim_states.pt"))):
        from toolkit.checkpoint.deepspeed_zero import open_zero_checkpoint

        checkpoint = open_zero_checkpoint(path)
        info.update(zero_stage=checkpoint.stage, world_size=checkpoint.world_size, optimizer_state=True,
                    parameters=sum(math.prod(s) for s in checkpoint.param_shapes.values()), dtypes=["float32 (master)"],
                    tag=checkpoint.tag_dir.name)
    elif fmt == "hf-trainer" and fsdp_dirs(root):
        model = [d for d in fsdp_dirs(root) if d.name.startswith("pytorch_model_fsdp")]
        info.update(_dcp_contents(model[0]) if model else {}, sharding="FSDP2 (torch DCP)",
                    optimizer_state=any(d.name.startswith("optimizer") for d in fsdp_dirs(root)))
    elif fmt in ("hf-safetensors", "hf-trainer"):
        from safetensors import safe_open

        count, dtypes = 0, set()
        for file in _safetensors_files(path, VerifyReport(str(path), fmt)):
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    sliced = handle.get_slice(key)
                    count += math.prod(sliced.get_shape())
                    dtypes.add(sliced.get_dtype())
        info.update(parameters=count, dtypes=sorted(dtypes), optimizer_state=(root / "optimizer.pt").is_file())
    elif fmt in ("megatron-dist", "dcp"):
        info.update(_dcp_contents(path))
    if (root / "trainer_state.json").is_file():
        info["step"] = json.loads((root / "trainer_state.json").read_text()).get("global_step", info.get("step"))
    if fmt == "hf-trainer" and fsdp_dirs(root):
        info["format"] = "hf-trainer+fsdp"
    info["manifest"] = (root / MANIFEST).is_file()
    return info


def _dcp_contents(path: Path) -> dict:
    """Parameters (tensors not under an `optimizer` key), whether optimizer state is there, dtypes, and how many rank
    files hold the chunks."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    return {"parameters": sum(math.prod(v.size) for k, v in tensors.items() if "optimizer" not in k),
            "optimizer_state": any("optimizer" in k for k in tensors),
            "dtypes": sorted({str(v.properties.dtype).removeprefix("torch.") for v in tensors.values()}),
            "rank_files": len({info.relative_path for info in metadata.storage_data.values()})}
