"""`dmt ckpt verify` / `inspect`: detect a checkpoint's format, check it is complete and intact, describe it.

Each backend's checkpoint part (toolkit/backends/<name>/checkpoint.py) detects, checks and describes its own format:
DeepSpeed ZeRO (a tag directory or a directory with `latest`, bare or inside HF's Trainer checkpoint), FSDP2's DCP
directories in a Trainer checkpoint, Megatron-Core dist checkpoints. The formats of no backend are checked here: HF
Trainer's checkpoint-N (trainer_state.json, weights as safetensors), a bare DCP directory (.metadata + *.distcp), HF
safetensors (model.safetensors or an index). With a manifest, every listed file must exist with its size and sha256;
without one, every file must open and shards must agree.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from toolkit.checkpoint.allow_lists import REFUSED
from toolkit.checkpoint.dcp_check import check_dcp, dcp_contents
from toolkit.checkpoint.finite import safetensors_findings
from toolkit.checkpoint.manifest import MANIFEST, manifest_problems, read_manifest
from toolkit.checkpoint.safe_load import path_faults, pickle_faults
from toolkit.checkpoint.safetensors_stream import safetensors_weight_map
from toolkit.errors import UserInputError
from toolkit.readers import not_a_file, read_json, read_safetensors_header
from toolkit.spec.backends import BACKENDS


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

    def scan(self, findings) -> None:
        """Count the tensors of a deep scan and report those that are not finite; a file that cannot be read ends
        that scan as one more problem."""
        try:
            for file, problem in findings:
                self.tensors_checked += 1
                if problem:
                    self.problem(file, problem)
        except UserInputError as exc:
            self.problem(exc.key, exc.message)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


HF_SAFETENSORS, HF_TRAINER, DCP = "hf-safetensors", "hf-trainer", "dcp"  # the formats of no backend
# NVRx's LocalCheckpointManager's (checkpoint.local): DIR/<session>/<rank>/iter_<7 digits>_<rank>_local.pt, each a
# torch.save of a TensorAwareStateDict, written as ...local.dirty.pt and renamed when complete
# (nvidia_resiliency_ext/checkpointing/local/ckpt_managers/local_manager.py)
NVRX_LOCAL = "nvrx-local"
NVRX_LOCAL_FILES = re.compile(r"iter_(\d{7})_(\d+)_local(\.dirty)?\.pt")


def checkpoint_parts() -> list[ModuleType]:
    """Each backend's checkpoint part that knows a format (a backend whose checkpoints are HF's own has none)."""
    return [part for part in (backend.checkpoint for backend in BACKENDS.values()) if part.detect is not None]


def detect(path: Path) -> tuple[str, ModuleType | None]:
    """The format of `path`, and the backend's checkpoint part that owns it (None for the formats of no backend)."""
    if not path.exists():
        raise UserInputError("PATH", f"{path} does not exist")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise UserInputError("PATH", f"{path} is not a checkpoint: give a checkpoint directory or a .safetensors "
                                         f"file")
        return HF_SAFETENSORS, None
    for part in checkpoint_parts():
        fmt = part.detect(path)
        if fmt is not None:
            return fmt, part
    if (path / ".metadata").is_file() and any(path.glob("*.distcp")):
        return DCP, None
    if nvrx_local_files(path):
        return NVRX_LOCAL, None
    if (path / "trainer_state.json").is_file():
        return HF_TRAINER, None
    if _has_safetensors(path):
        return HF_SAFETENSORS, None
    raise UserInputError("PATH", f"{path}: no known checkpoint format (DeepSpeed ZeRO, HF Trainer, Megatron dist, HF "
                                 f"safetensors, NVRx local)")


def _has_safetensors(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()


def verify(path: Path, deep: bool = False) -> VerifyReport:
    fmt, part = detect(path)
    report = VerifyReport(path=str(path), format=fmt)
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
    trainer = path.is_dir() and (path / "trainer_state.json").is_file()
    if trainer:
        _check_trainer_state(path, report)
    if part is not None:
        part.verify(path, report, deep)
    elif fmt == DCP:
        check_dcp(path, report, deep)
    elif fmt == NVRX_LOCAL:
        _check_nvrx_local(path, report)
    if fmt == HF_SAFETENSORS or (trainer and _has_safetensors(path)):
        _check_safetensors(path, report, deep)
    if part is None and fmt == HF_TRAINER and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        report.problem(path, "HF Trainer checkpoint without model weights")
    if path.is_dir():
        _check_pickles(path, report)
    return report


def nvrx_local_files(path: Path) -> dict[Path, re.Match]:
    """NVRx's local checkpoint files in a rank's directory, a session's (its rank directories) or the root above."""
    found = {}
    for pattern in ("*.pt", "*/*.pt", "*/*/*.pt"):
        for file in path.glob(pattern):
            match = NVRX_LOCAL_FILES.fullmatch(file.name)
            if match and not file.is_dir():  # a FIFO or a link by that name is one too, for path_faults to name
                found[file] = match
    return found


def _check_nvrx_local(path: Path, report: VerifyReport) -> None:
    """NVRx's local checkpoints: no save left half-written (`.dirty`), no empty file, and a step that every rank
    directory holds (the one NVRx's find_latest resumes; without replication a rank reads only its own files). Their
    pickles are checked against their allow-list with every checkpoint's (_check_pickles, allow_lists.NVRX_LOCAL)."""
    steps: dict[Path, set[int]] = {}
    for file, match in sorted(nvrx_local_files(path).items()):
        if match.group(3):
            report.problem(file, "a save NVRx did not finish (.dirty): that step is not complete on this rank")
            continue
        if not_a_file(file) is not None or not file.exists():  # what it is (or where it leads): path_faults says
            continue
        if file.stat().st_size == 0:
            report.problem(file, "empty")
            continue
        report.files_checked += 1
        steps.setdefault(file.parent, set()).add(int(match.group(1)))
    by_session: dict[Path, dict[Path, set[int]]] = {}
    for rank_dir, held in steps.items():
        by_session.setdefault(rank_dir.parent, {})[rank_dir] = held
    for session, ranks in by_session.items():
        if len(ranks) > 1 and not set.intersection(*ranks.values()):
            report.problem(session, f"no step every rank holds ({', '.join(f'{d.name}: {sorted(s)}' for d, s in sorted(ranks.items()))}): NVRx resumes none of them")


def _check_pickles(path: Path, report: VerifyReport) -> None:
    """Every entry a loader would open that blocks, reads without end or leads outside the checkpoint (path_faults),
    and every pickle a library's loader would unpickle (DCP metadata and objects, DeepSpeed rank files, Megatron's
    common.pt, HF Trainer's state files) against its format's allow-list: each that asks for anything else is a
    problem, and so is one damaged (or compressed) that no format's own check has named."""
    named = {p["file"] for p in report.problems}
    for fault in path_faults(path, None):
        if fault.key not in named:  # not already said by a format's own check
            report.problem(fault.key, fault.message)
            named.add(fault.key)
    said = {p["file"] for p in report.problems if REFUSED in p["problem"]}
    for fault in pickle_faults(path, None):
        if fault.key not in (said if REFUSED in fault.message else named):  # not already said by a format's check
            report.problem(fault.key, fault.message)
            said.add(fault.key)
            named.add(fault.key)


def _check_trainer_state(path: Path, report: VerifyReport) -> None:
    try:
        # HF's Trainer writes a NaN or infinite loss into log_history as it happened (json.dump allows it): in its
        # own state file that is a record, not a damaged number
        read_json(path / "trainer_state.json", what="HF Trainer's state (a JSON object)", finite=False)
    except UserInputError as exc:
        report.problem(path / "trainer_state.json", exc.message)


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
    for file in _safetensors_files(path, report):
        try:
            read_safetensors_header(file)
        except UserInputError as exc:
            report.problem(file, exc.message)
            continue
        report.files_checked += 1
        if deep:
            report.scan(safetensors_findings(file))


def inspect(path: Path) -> dict:
    """What is in a checkpoint directory or one weights file: format, step, layout, parameters, optimizer state,
    dtypes, size (the file's own for a file). Unreadable parts are a UserInputError naming the file."""
    fmt, part = detect(path)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    info: dict = {"path": str(path), "format": fmt, "bytes": sum(f.stat().st_size for f in files)}
    manifest = read_manifest(path) if path.is_dir() else None
    if manifest:
        info.update(step=manifest.get("step"), world_size=manifest.get("world_size"), layout=manifest.get("layout"))
    if part is not None:
        info.update(part.inspect(path))
    elif fmt == DCP:
        info.update(dcp_contents(path))
    elif fmt == NVRX_LOCAL:
        info["local_checkpoints"] = sorted(
            ({"rank_dir": str(file.parent), "step": int(match.group(1)), "rank": int(match.group(2)),
              "complete": not match.group(3)} for file, match in nvrx_local_files(path).items()), key=str)
    else:
        report = VerifyReport(str(path), fmt)
        headers = [read_safetensors_header(file) for file in _safetensors_files(path, report)]
        if report.problems:
            raise UserInputError(report.problems[0]["file"], report.problems[0]["problem"])
        entries = [entry for header in headers for entry in header.values()]
        info.update(parameters=sum(math.prod(e["shape"]) for e in entries), dtypes=sorted({e["dtype"] for e in entries}),
                    optimizer_state=path.is_dir() and (path / "optimizer.pt").is_file())
    if path.is_dir() and (path / "trainer_state.json").is_file():
        info["step"] = read_json(path / "trainer_state.json", finite=False).get("global_step", info.get("step"))
    info["manifest"] = path.is_dir() and (path / MANIFEST).is_file()
    return info
