"""Checkpoint manifests (files, sizes, sha256, layout, step, versions) and the atomic `latest` pointer.

A checkpoint is complete only once `dmt_manifest.json` is written, and `latest` moves to it only after that, each by
write-to-temp + fsync + rename: a crash mid-save leaves the previous checkpoint as `latest`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from importlib import metadata
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import inside, not_a_file, open_regular, read_json, read_text
from toolkit.runtime.supervision import LATEST_POINTER as LATEST  # OUTPUT/latest: one name for the watchdog and here

MANIFEST = "dmt_manifest.json"
LIBRARIES = ("dm-toolkit", "torch", "deepspeed", "megatron-core", "transformers", "accelerate")
CHUNK = 8 * 2**20


def sha256_file(path: Path) -> str:
    """The sha256 of a regular file's bytes, as many as it held when opened (one that grows is not read on)."""
    digest = hashlib.sha256()
    with open_regular(path, None, "a checkpoint file") as handle:
        left = os.fstat(handle.fileno()).st_size
        while left > 0 and (block := handle.read(min(CHUNK, left))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see either the old content or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def hash_files(ckpt_dir: Path) -> dict:
    """Size and sha256 of every file under `ckpt_dir` (the manifest itself excepted): the manifest's `files`."""
    files = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST and ".tmp-" not in p.name):
        files[path.relative_to(ckpt_dir).as_posix()] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return files


def write_manifest(ckpt_dir: Path, *, step: int, world_size: int, layout: dict, fmt: str, extra: dict | None = None,
                   files: dict | None = None) -> dict:
    """Hash every file under `ckpt_dir` (unless `files`, hash_files' answer, was taken once they were complete) and
    write the manifest atomically."""
    files = hash_files(ckpt_dir) if files is None else files
    manifest = {
        "format": fmt,
        "step": step,
        "world_size": world_size,
        "layout": layout,
        "files": files,
        "versions": library_versions(),
        "created_unix": time.time(),
        **(extra or {}),
    }
    atomic_write_text(ckpt_dir / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_manifest(ckpt_dir: Path) -> dict | None:
    """The manifest of `ckpt_dir` (None when it has none); a damaged one is a UserInputError naming it."""
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        return None
    what = 'a dmt manifest: {"files": {"<relative path>": {"bytes": <int>, "sha256": "<hex>"}, ...}, ...}'
    manifest = read_json(path, what=what)
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise UserInputError(str(path), f"has no 'files' object; expected {what}")
    for rel, entry in files.items():
        parts = Path(rel).parts
        if (not parts or Path(rel).is_absolute() or ".." in parts or not isinstance(entry, dict)
                or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str)):
            raise UserInputError(str(path), f"files[{rel!r}] is {json.dumps(entry)[:80]}; expected {what}")
    return manifest


def manifest_problems(root: Path, manifest: dict, only: set[Path] | None = None,
                      hash_up_to: int | None = None) -> list[tuple[Path, str]]:
    """(file, problem) for each file the manifest lists (those in `only`, when given) that is missing, has another
    size or, if no larger than `hash_up_to` bytes (None: every file), another sha256."""
    problems = []
    wanted = None if only is None else {path.resolve() for path in only}
    for rel, expected in manifest["files"].items():
        file = root / rel
        if wanted is not None and file.resolve() not in wanted:
            continue
        if not file.resolve().is_relative_to(root.resolve()):
            problems.append((file, f"resolves to {file.resolve()}, outside the checkpoint"))
            continue
        if not_a_file(file):
            problems.append((file, f"is {not_a_file(file)}, not a regular file"))
            continue
        if not file.is_file():
            problems.append((file, "listed in the manifest but missing"))
            continue
        size = file.stat().st_size
        if size != expected["bytes"]:
            problems.append((file, f"size {size} bytes, manifest says {expected['bytes']} (truncated or replaced)"))
        elif (hash_up_to is None or size <= hash_up_to) and sha256_file(file) != expected["sha256"]:
            problems.append((file, "sha256 differs from the manifest (bytes changed)"))
    return problems


def point_latest(root: Path, ckpt_dir: Path) -> None:
    """Move `root/latest` to `ckpt_dir` (a child of root); call only after its manifest is written."""
    if not (ckpt_dir / MANIFEST).is_file():
        raise ValueError(f"{ckpt_dir} has no {MANIFEST}; refusing to make it latest")
    atomic_write_text(root / LATEST, ckpt_dir.name + "\n")


def checkpoint_step(ckpt_dir: Path) -> int | None:
    """N of a `checkpoint-N` directory; None for any other name."""
    prefix, _, number = ckpt_dir.name.rpartition("-")
    return int(number) if prefix == "checkpoint" and number.isdigit() else None


def latest_verified(root: Path) -> Path | None:
    """The checkpoint a restart or a rollback continues from: the one `latest` names, or the newest before it,
    whose manifest is readable and whose files all exist with the manifest's sizes (hashing every file of a large
    checkpoint would delay every restart; `dmt ckpt verify` does that). None when there is none."""
    pointed = resolve_latest(root)
    candidates = sorted((p for p in root.glob("checkpoint-*") if p.is_dir() and checkpoint_step(p) is not None),
                        key=checkpoint_step, reverse=True) if root.is_dir() else []
    if pointed is not None:
        candidates = [pointed] + [p for p in candidates if checkpoint_step(p) < (checkpoint_step(pointed) or 0)]
    for ckpt in candidates:
        try:
            manifest = read_manifest(ckpt)
        except UserInputError:
            manifest = None
        if manifest is not None and not manifest_problems(ckpt, manifest, hash_up_to=-1):
            return ckpt
    return None


def resolve_latest(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, or None when there is none."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    what = "the name of a checkpoint directory beside it"
    target = inside(root, read_text(pointer, what=what).strip(), str(pointer), what)
    return target if target.is_dir() else None


def data_position(step: int, identity: dict) -> dict:
    """What a checkpoint records of the data stream: the samples consumed, a global count (a resume on another
    data-parallel size reads on from the same sample)."""
    return {"consumed_samples": step * identity["global_batch"]}


def consumed_samples(checkpoint: Path | None) -> int:
    """The samples a checkpoint's run had consumed (0 without one)."""
    if checkpoint is None:
        return 0
    manifest = read_manifest(checkpoint) or {}
    if "consumed_samples" in manifest:
        return int(manifest["consumed_samples"])
    return int(manifest.get("step", 0)) * int(manifest.get("run", {}).get("global_batch", 0))
