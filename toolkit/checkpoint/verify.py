"""`dmt ckpt verify` / `inspect`: detect a checkpoint's format, check it is complete and intact, describe it.

Formats: DeepSpeed ZeRO (a tag directory or a directory with `latest`), HF Trainer (checkpoint-N with
trainer_state.json, weights as safetensors, a DeepSpeed tag or FSDP2's DCP directories pytorch_model_fsdp_0/ and
optimizer_0/), Megatron-Core dist checkpoints (metadata.json + *.distcp, torch.distributed.checkpoint), a bare DCP
directory (.metadata + *.distcp), HF safetensors (model.safetensors or an index). With a manifest, every listed file
must exist with its size and sha256; without one, every file must open and shards must agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.checkpoint.manifest import MANIFEST, manifest_problems, read_manifest
from toolkit.checkpoint.safe_load import read_dcp_metadata
from toolkit.checkpoint.safetensors_stream import safetensors_weight_map
from toolkit.errors import UserInputError
from toolkit.readers import read_json, read_safetensors_header


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
        if path.suffix != ".safetensors":
            raise UserInputError("PATH", f"{path} is not a checkpoint: give a checkpoint directory or a .safetensors "
                                         f"file")
        return "hf-safetensors"
    if (path / "metadata.json").is_file() and any(path.glob("*.distcp")):
        return "megatron-dist"
    if (path / ".metadata").is_file() and any(path.glob("*.distcp")):
        return "dcp"
    if (path / "trainer_state.json").is_file():
        return "hf-trainer"
    if any(path.glob("*_optim_states.pt")) or ((path / "latest").is_file() and any(path.glob("*/*_optim_states.pt"))):
        return "deepspeed-zero"
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return "hf-safetensors"
    raise UserInputError("PATH", f"{path}: no known checkpoint format (DeepSpeed ZeRO, HF Trainer, Megatron dist, HF safetensors)")


def verify(path: Path, deep: bool = False) -> VerifyReport:
    fmt = detect_format(path)
    report = VerifyReport(path=str(path), format="hf-trainer+fsdp" if fmt == "hf-trainer" and fsdp_dirs(path) else fmt)
    root = path if path.is_dir() else path.parent
    try:
        manifest = read_manifest(root) if path.is_dir() else None
    except UserInputError as exc:  # a damaged manifest is a damaged checkpoint
        report.problem(root / MANIFEST, exc.message)
        manifest = None
    if manifest is not None:
        report.manifest = True
        report.files_checked += len(manifest["files"])
        for file, problem in manifest_problems(root, manifest):
            report.problem(file, problem)
    if fmt == "deepspeed-zero":
        _check_zero(path, report, deep)
    elif fmt == "hf-trainer":
        _check_hf_trainer(path, report, deep)
    elif fmt in ("megatron-dist", "dcp"):
        _check_dcp(path, report, deep)
    else:
        _check_safetensors(path, report, deep)
    if path.is_dir():
        _check_pickles(path, report)
    return report


def _check_pickles(path: Path, report: VerifyReport) -> None:
    """Every pickle a library's loader would unpickle (DCP metadata and objects, DeepSpeed rank files, Megatron's
    common.pt), against its format's allow-list: each that asks for anything else is a problem (damaged ones are
    the format checks' to report)."""
    from toolkit.checkpoint.safe_load import REFUSED, pickle_faults

    said = {p["file"] for p in report.problems if REFUSED in p["problem"]}
    for fault in pickle_faults(path, None):
        if REFUSED in fault.message and fault.key not in said:  # not already refused by a format's own check
            report.problem(fault.key, fault.message)
            said.add(fault.key)


def _check_zero(path: Path, report: VerifyReport, deep: bool) -> None:
    from toolkit.checkpoint.deepspeed_zero import open_zero_checkpoint

    try:
        checkpoint = open_zero_checkpoint(path)
    except UserInputError as exc:
        report.problem(exc.key, exc.message)
        return
    report.files_checked = max(report.files_checked, len(list(checkpoint.tag_dir.iterdir())))
    if deep:
        from toolkit.checkpoint.finite import zero_findings

        _scan(zero_findings(checkpoint), report)


def _check_hf_trainer(path: Path, report: VerifyReport, deep: bool) -> None:
    try:
        # HF's Trainer writes a NaN or infinite loss into log_history as it happened (json.dump allows it): in its
        # own state file that is a record, not a damaged number
        read_json(path / "trainer_state.json", what="HF Trainer's state (a JSON object)", finite=False)
    except UserInputError as exc:
        report.problem(path / "trainer_state.json", exc.message)
    tags = [p for p in path.iterdir() if p.is_dir() and any(p.glob("*_optim_states.pt"))]
    if tags:
        _check_zero(path, report, deep)
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        _check_safetensors(path, report, deep)
    sharded = fsdp_dirs(path)  # FSDP2 (Accelerate's SHARDED_STATE_DICT): one DCP directory each for model, optimizer
    for directory in sharded:
        _check_dcp(directory, report, deep)
    if not tags and not sharded and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        report.problem(path, "HF Trainer checkpoint without model weights")


def _safetensors_files(path: Path, report: VerifyReport) -> list[Path]:
    """A file itself, or every .safetensors file of a directory and every one its index names (each must exist)."""
    if path.is_file():
        return [path]
    files = set(path.glob("*.safetensors"))
    try:
        weight_map = safetensors_weight_map(path) if (path / "model.safetensors.index.json").is_file() else {}
    except UserInputError as exc:
        report.problem(exc.key, exc.message)
        weight_map = {}
    for name in sorted(set(weight_map.values())):
        if not (path / name).is_file():
            report.problem(path / name, "named in model.safetensors.index.json but missing")
    return sorted(files)


def _check_safetensors(path: Path, report: VerifyReport, deep: bool) -> None:
    from toolkit.checkpoint.finite import safetensors_findings

    for file in _safetensors_files(path, report):
        try:
            read_safetensors_header(file)
        except UserInputError as exc:
            report.problem(file, exc.message)
            continue
        report.files_checked += 1
        if deep:
            _scan(safetensors_findings(file), report)


def fsdp_dirs(path: Path) -> list[Path]:
    """The DCP directories Accelerate's FSDP saving writes into a Trainer checkpoint (pytorch_model_fsdp_0,
    optimizer_0)."""
    return sorted(p for p in path.glob("*_0") if p.is_dir() and (p / ".metadata").is_file()
                  and p.name.split("_")[0] in ("pytorch", "optimizer"))


def _check_dcp(path: Path, report: VerifyReport, deep: bool) -> None:
    """A torch DCP directory (Megatron-Core's, FSDP2's): metadata readable, every storage file it names present and
    long enough; with `deep`, every tensor read chunk by chunk."""
    try:
        metadata = read_dcp_metadata(path)
    except UserInputError as exc:
        report.problem(path / ".metadata", exc.message)
        return
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        file = path / rel
        if not file.is_file():
            report.problem(file, "storage file named by the checkpoint metadata is missing")
            continue
        report.files_checked += 1
        if file.stat().st_size < end:
            report.problem(file, f"{file.stat().st_size} bytes, metadata needs {end} (truncated)")
    if deep:  # a damaged file too: the scan reports what it reads, and the first read that fails
        from toolkit.checkpoint.finite import dcp_findings

        _scan(dcp_findings(path, metadata), report)


def _scan(findings, report: VerifyReport) -> None:
    """Count the tensors of a deep scan and report those that are not finite; a file that cannot be read ends that
    scan as one more problem."""
    try:
        for file, problem in findings:
            report.tensors_checked += 1
            if problem:
                report.problem(file, problem)
    except UserInputError as exc:
        report.problem(exc.key, exc.message)


def inspect(path: Path) -> dict:
    """What is in a checkpoint directory or one weights file: format, step, layout, parameters, optimizer state,
    dtypes, size (the file's own for a file). Unreadable parts are a UserInputError naming the file."""
    fmt = detect_format(path)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    info: dict = {"path": str(path), "format": fmt, "bytes": sum(f.stat().st_size for f in files)}
    manifest = read_manifest(path) if path.is_dir() else None
    if manifest:
        info.update(step=manifest.get("step"), world_size=manifest.get("world_size"), layout=manifest.get("layout"))
    if fmt in ("deepspeed-zero", "hf-trainer") and (any(path.glob("*/*_optim_states.pt")) or any(path.glob("*_optim_states.pt"))):
        from toolkit.checkpoint.deepspeed_zero import open_zero_checkpoint

        checkpoint = open_zero_checkpoint(path)
        info.update(zero_stage=checkpoint.stage, world_size=checkpoint.world_size, optimizer_state=True,
                    parameters=sum(math.prod(s) for s in checkpoint.param_shapes.values()), dtypes=["float32 (master)"],
                    tag=checkpoint.tag_dir.name)
    elif fmt == "hf-trainer" and fsdp_dirs(path):
        model = [d for d in fsdp_dirs(path) if d.name.startswith("pytorch_model_fsdp")]
        info.update(_dcp_contents(model[0]) if model else {}, sharding="FSDP2 (torch DCP)", format="hf-trainer+fsdp",
                    optimizer_state=any(d.name.startswith("optimizer") for d in fsdp_dirs(path)))
    elif fmt in ("hf-safetensors", "hf-trainer"):
        report = VerifyReport(str(path), fmt)
        headers = [read_safetensors_header(file) for file in _safetensors_files(path, report)]
        if report.problems:
            raise UserInputError(report.problems[0]["file"], report.problems[0]["problem"])
        entries = [entry for header in headers for entry in header.values()]
        info.update(parameters=sum(math.prod(e["shape"]) for e in entries), dtypes=sorted({e["dtype"] for e in entries}),
                    optimizer_state=path.is_dir() and (path / "optimizer.pt").is_file())
    elif fmt in ("megatron-dist", "dcp"):
        info.update(_dcp_contents(path))
    if path.is_dir() and (path / "trainer_state.json").is_file():
        info["step"] = read_json(path / "trainer_state.json", finite=False).get("global_step", info.get("step"))
    info["manifest"] = path.is_dir() and (path / MANIFEST).is_file()
    return info


def _dcp_contents(path: Path) -> dict:
    """Parameters (tensors not under an `optimizer` key), whether optimizer state is there, dtypes, and how many rank
    files hold the chunks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(path)
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    return {"parameters": sum(math.prod(v.size) for k, v in tensors.items() if "optimizer" not in k),
            "optimizer_state": any("optimizer" in k for k in tensors),
            "dtypes": sorted({str(v.properties.dtype).removeprefix("torch.") for v in tensors.values()}),
            "rank_files": len({info.relative_path for info in metadata.storage_data.values()})}
