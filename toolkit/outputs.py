"""Writing what a command was asked to write without losing what the user had: every target checked before anything
is written, never an input overwritten, files written under a temporary name and renamed into place, nothing left
behind on failure, nor when interrupted. Problems are one UserInputError line naming the flag."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from toolkit.errors import UserInputError, interrupted


def _resolved(path: Path | str, flag: str) -> Path:
    if str(path).strip() == "":
        raise UserInputError(flag, "is empty; give a path")
    return Path(path).expanduser().resolve()


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _writable_directory(directory: Path, flag: str, target: Path) -> None:
    """The nearest existing ancestor of `directory` must be a directory we can create a file in: tried for real
    (permission bits say nothing for root, or for read-only and virtual file systems), then removed."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserInputError(flag, f"{target}: {existing} is a file, not a directory")
    try:
        handle, probe = tempfile.mkstemp(prefix=".dmt-probe-", dir=existing)
    except OSError as exc:
        raise UserInputError(flag, f"{target}: cannot write into {existing} ({exc.strerror or exc})") from None
    os.close(handle)
    os.unlink(probe)


def output_file(path: Path | str, flag: str, inputs: Iterable[Path] = (), suffix: str | None = None) -> Path:
    """A file a command will write: not a directory, not one of its inputs, in an existing directory it can write."""
    target = _resolved(path, flag)
    if suffix is not None and target.suffix.lower() != suffix:
        raise UserInputError(flag, f"expects a {suffix} file name, got {path}")
    if target.is_dir():
        raise UserInputError(flag, f"{target} is a directory; give a file name")
    for source in inputs:
        if _same_file(target, Path(source)):
            raise UserInputError(flag, f"{target} is an input of this command; write somewhere else")
    if not target.parent.exists():
        raise UserInputError(flag, f"directory {target.parent} does not exist")
    _writable_directory(target.parent, flag, target)
    return target


def output_directory(path: Path | str, flag: str, inputs: Iterable[Path] = ()) -> Path:
    """A directory a command will create or write into: not a file, not holding an input's path, creatable."""
    target = _resolved(path, flag)
    if target.exists() and not target.is_dir():
        raise UserInputError(flag, f"{target} is a file; give a directory")
    for source in inputs:
        if _same_file(target, Path(source)):
            raise UserInputError(flag, f"{target} is an input of this command; write somewhere else")
    _writable_directory(target, flag, target)
    return target


def write_file(path: Path, data: str | bytes, flag: str, mode: int | None = None) -> None:
    """Write `data` to a temporary sibling, fsync, then rename over `path`: readers see the old file or the new one;
    a failure (a read-only file system, a full disk) is one line naming `flag`, with nothing left behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        raise UserInputError(flag, f"cannot write {path} ({exc.strerror or exc})") from None
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def removed_if_interrupted(directory: Path, whole: bool | None = None):
    """A directory a command fills (a run's working directory): interrupted (Ctrl-C), what the block made there is
    removed, the directory too when the command made it (`whole`; default: it did not exist before); the interrupt
    says what went. A block that fails otherwise keeps it: its logs say why."""
    directory = Path(directory)
    whole = not directory.exists() if whole is None else whole
    before = set() if whole else set(directory.iterdir())
    try:
        yield directory
    except KeyboardInterrupt as exc:
        made = [directory] if whole else sorted(set(directory.iterdir()) - before)
        for path in made:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        what = str(directory) if whole else f"{', '.join(p.name for p in made)} from {directory}"
        raise (interrupted(exc, f"removed {what}") if made else exc) from None


def save_figure(fig, path: Path, dpi: int) -> None:
    """A matplotlib figure written to `path` (checked by output_file) through a temporary sibling: the plot appears
    whole or not at all; the figure is closed either way."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=dpi)
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


RECORD = ".dmt-generated.json"  # the files `dmt generate` wrote into a directory, with what it wrote


def _record(directory: Path) -> dict[str, str]:
    try:
        data = json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and all(isinstance(v, str) for v in data.values()) else {}


def _ours(path: Path, record: dict[str, str]) -> bool:
    """Whether `path` is a file this tool wrote and nobody changed since."""
    digest = record.get(path.name)
    if digest is None or not path.is_file():
        return False
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() == digest
    except OSError:
        return False


def write_generated(directory: Path, contents: dict[str, str], flag: str, inputs: Iterable[Path] = (),
                    force: bool = False, executable: Iterable[str] = ()) -> list[Path]:
    """Write a set of generated files into `directory` together. Every target is checked first: none may be a
    directory or an input; a file there that this tool did not write (or that was edited since) is replaced only with
    `force`. Files are staged in a sibling directory and moved in; files this tool wrote before that the new set no
    longer has (another backend's) are removed. The record of what was written is kept in the directory."""
    directory = output_directory(directory, flag, inputs)
    inputs = [Path(p) for p in inputs]
    record = _record(directory) if directory.is_dir() else {}
    stale = [directory / name for name in record if name not in contents and (directory / name).exists()]
    for name in contents:
        target = directory / name
        if any(_same_file(target, source) for source in inputs):
            raise UserInputError(flag, f"{target} is an input of this command; write somewhere else")
        if target.is_dir() or target.is_symlink():
            raise UserInputError(flag, f"{target} is a {'directory' if target.is_dir() else 'link'}; move it away or "
                                       f"choose another {flag}")
    if not force:
        foreign = [p for p in [directory / n for n in contents] + stale if p.exists() and not _ours(p, record)]
        if foreign:
            names = ", ".join(p.name for p in foreign)
            raise UserInputError(flag, f"{directory} holds {names}, not written by this tool (or edited since); "
                                       f"--force replaces {'them' if len(foreign) > 1 else 'it'}")
    executable = set(executable)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserInputError(flag, f"cannot create {directory.parent} ({exc.strerror})") from None
    staging = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        for name, text in contents.items():
            (staging / name).write_text(text)
            os.chmod(staging / name, 0o755 if name in executable else 0o644)
        (staging / RECORD).write_text(json.dumps({n: sha256_text(t) for n, t in contents.items()}, indent=1) + "\n")
        if not directory.exists():
            staging.chmod(0o755)
            os.rename(staging, directory)  # the whole directory appears at once
        else:
            for name in [*contents, RECORD]:
                os.replace(staging / name, directory / name)
            for path in stale:
                path.unlink(missing_ok=True)
    except OSError as exc:
        raise UserInputError(flag, f"cannot write into {directory} ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [directory / name for name in contents]
