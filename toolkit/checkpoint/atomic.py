"""Write a directory or file under a temporary name in the destination's filesystem and rename it when complete."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from toolkit.errors import UserInputError


@contextmanager
def atomic_directory(out: Path, flag: str = "OUT_DIR") -> Iterator[Path]:
    """Yield a temporary sibling of `out`; on success it becomes `out`, on failure it is removed.

    An interrupted writer therefore never leaves a half-written directory under the final name.
    """
    out = out.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(flag, f"{out} already exists and is not empty; choose a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
