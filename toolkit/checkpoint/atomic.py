"""Output directories of the converters: refused before anything is written when they cannot be made, written under
a temporary sibling and renamed when complete, and the temporary siblings that killed writers left removed."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from toolkit.errors import UserInputError, interrupted
from toolkit.outputs import input_at, not_a_link

log = logging.getLogger(__name__)
TEMP_MARK = ".tmp-"


def check_output_dir(out: Path, flag: str = "OUT_DIR", inputs: Iterable[Path | None] = ()) -> Path:
    """`out`, absolute, if a new directory can be made there; otherwise a UserInputError at `flag` saying why.
    Nothing is left behind (a probe directory is made and removed): a refused conversion leaves the file system as
    it found it."""
    out = Path(out).expanduser().absolute()
    if input_at(out, inputs, inside=False) is not None:  # `inputs` and every input the command line named
        raise UserInputError(flag, f"{out} is one of the inputs; choose a new directory for the output")
    not_a_link(out, flag, "choose a new directory")  # os.replace would replace the link, after all the work
    if out.is_file():
        raise UserInputError(flag, f"{out} is an existing file; choose a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise UserInputError(flag, f"{out} already exists and is not empty; choose a new directory")
    ancestor = out.parent  # where the temporary sibling goes, or the nearest existing directory above it
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserInputError(flag, f"{out} lies under {ancestor}, which is a file; choose a path in a directory")
    try:  # trying is the only sure test: permissions do not bind root, nor tell of read-only or special mounts
        os.rmdir(tempfile.mkdtemp(prefix=".dmt-probe-", dir=ancestor))
    except OSError as exc:
        raise UserInputError(flag, f"{out} cannot be created in {ancestor} ({exc.strerror}); choose another "
                                   f"place") from None
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        return True
    return True


def remove_stale_temps(out: Path) -> None:
    """Remove the temporary siblings of `out` whose writer is gone (killed mid-write: Ctrl-C twice, SIGKILL, OOM).

    The owner is in the name, `.OUT.tmp-PID@HOST` (`.OUT.tmp-PID` before hosts were recorded): one written on another
    host of a shared file system, or whose process still runs, is left alone."""
    prefix = f".{out.name}{TEMP_MARK}"
    with os.scandir(out.parent) as entries:
        stale = [Path(e.path) for e in entries if e.name.startswith(prefix)]
    for path in stale:
        pid, _, host = path.name[len(prefix):].partition("@")
        if not pid.isdigit() or (host and host != socket.gethostname()) or _alive(int(pid)):
            continue
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log.warning("removed %s (%.1f MiB), left by process %s, which no longer runs (an interrupted conversion)",
                    path, size / 2**20, pid)


@contextmanager
def atomic_directory(out: Path, flag: str = "OUT_DIR", inputs: Iterable[Path | None] = ()) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; on success it becomes `out`, on failure it is removed, with any parent
    directories made for it. An interrupted writer therefore never leaves a half-written directory under the final
    name, and a refused one nothing at all."""
    out = check_output_dir(out, flag, inputs)
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    tmp = out.parent / f".{out.name}{TEMP_MARK}{os.getpid()}@{socket.gethostname()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out)
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own, from an attempt interrupted while cleaning up
        tmp.mkdir()
    except OSError as exc:
        _remove_made(made)
        raise UserInputError(flag, f"{out} cannot be created ({exc.strerror}); choose another place") from None
    try:
        yield tmp
        _fsync_tree(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_made(made)
        if isinstance(exc, KeyboardInterrupt):
            raise interrupted(exc, f"removed what it had written of {out}") from None
        raise


def _remove_made(made: list[Path]) -> None:
    for path in made:  # deepest first; one that something else has filled since stays
        try:
            path.rmdir()
        except OSError:
            return


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
