"""Resume a DeepSpeed run at another world size: DeepSpeed's own `ds_to_universal` turns the ZeRO checkpoint into a
universal one, which the engine loads at any data-parallel size (`checkpoint.load_universal`).

The user's checkpoint is never touched: its files are hard-linked into OUTPUT/universal/<checkpoint>/ and the
universal tag is written there (through a temporary name, renamed when complete), beside `latest_universal` and
`universal_source.json`, which names the checkpoint it was made from: a copy of another checkpoint of the same name
(an output directory reused for another run) is made again, never resumed from.
HF Trainer then resumes from that directory (its trainer state, RNG and DeepSpeed tags are all there).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import read_text

log = logging.getLogger(__name__)
MARKER = "latest_universal"  # what DeepSpeed's engine reads when load_universal is set
SOURCE = "universal_source.json"  # {checkpoint: resolved path, fingerprint: its files' names, sizes and mtimes}


def universal_checkpoint(ckpt: Path, output_dir: Path) -> Path:
    """The universal copy of `ckpt` (made by rank 0 on first use; every rank returns once it exists)."""
    import torch.distributed as dist

    target = output_dir / "universal" / ckpt.name
    if dist.get_rank() == 0 and not _made_from(target, ckpt):
        _convert(ckpt, target)
    dist.barrier()
    return target


def _source(ckpt: Path) -> dict:
    """What identifies the checkpoint a universal copy is made from: its path, and every file's name, size and
    modification time (a checkpoint saved again under the same name differs in them)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and not p.is_symlink()):
        stat = path.stat()
        digest.update(f"{path.relative_to(ckpt)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"checkpoint": str(ckpt.resolve()), "fingerprint": digest.hexdigest()}


def _made_from(target: Path, ckpt: Path) -> bool:
    """Whether `target` is a complete universal copy of this very checkpoint."""
    if not (target / MARKER).is_file() or not (target / SOURCE).is_file():
        return False
    try:
        return json.loads((target / SOURCE).read_text()) == _source(ckpt)
    except (OSError, ValueError):  # unreadable or not JSON: made again
        return False


def _convert(ckpt: Path, target: Path) -> None:
    tag_file = ckpt / "latest"
    if not tag_file.is_file():
        raise UserInputError("--resume", f"{ckpt} has no DeepSpeed `latest` tag file: not a DeepSpeed checkpoint")
    tag = read_text(tag_file, "--resume", what="the name of the checkpoint's tag directory").strip()
    source = _source(ckpt)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ckpt, tmp, copy_function=_link_or_copy)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tmp / tag),
           "--output_folder", str(tmp / f"{tag}_universal"), "--inject_missing_state", "--num_extract_workers", "1",
           "--num_merge_workers", "1"]
    log.info("world size changed: converting %s to a universal checkpoint (%s)", ckpt, " ".join(cmd))
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not (tmp / MARKER).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserInputError("--resume", f"DeepSpeed's ds_to_universal could not convert {ckpt.name}: {last}")
    (tmp / SOURCE).write_text(json.dumps(source))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def _link_or_copy(source: str, destination: str) -> None:
    """Hard links cost no space; a copy where links are not possible (another filesystem)."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
