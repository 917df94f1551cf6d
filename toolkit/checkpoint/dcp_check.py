"""`dmt ckpt verify|inspect` of a torch.distributed.checkpoint directory (Megatron-Core's, FSDP2's): its metadata,
the storage files it names, and with --deep every tensor scanned (toolkit/checkpoint/finite.py)."""

from __future__ import annotations

from pathlib import Path

from toolkit.checkpoint.finite import dcp_findings
from toolkit.checkpoint.safe_load import read_dcp_metadata
from toolkit.errors import UserInputError


def check_dcp(path: Path, report, deep: bool) -> None:
    """A DCP directory (Megatron-Core's, FSDP2's) into a VerifyReport: metadata readable, every storage file it names
    present and long enough; with `deep`, every tensor read chunk by chunk."""
    try:
        metadata = read_dcp_metadata(path)  # every storage path inside the checkpoint, a regular file or missing
    except UserInputError as exc:
        report.problem(exc.key, exc.message)
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
        report.scan(dcp_findings(path, metadata))


def dcp_contents(path: Path) -> dict:
    """Parameters (tensors not under an `optimizer` key), whether optimizer state is there, dtypes, and how many rank
    files hold the chunks."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(path)
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    return {"parameters": sum(math.prod(v.size) for k, v in tensors.items() if "optimizer" not in k),
            "optimizer_state": any("optimizer" in k for k in tensors),
            "dtypes": sorted({str(v.properties.dtype).removeprefix("torch.") for v in tensors.values()}),
            "rank_files": len({info.relative_path for info in metadata.storage_data.values()})}
