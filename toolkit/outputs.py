"""Writing what a command was asked to write without losing what the user had: every target checked before anything
is written, never an input overwritten, files written under a temporary name and renamed into place, nothing left
behind on failure, nor when interrupted. Problems are one UserInputError line naming the flag."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from toolkit.errors import UserInputError, interrupted
from toolkit.readers import read_json

# Every input path of the command being run, registered as its command line is parsed (toolkit.cli.paths: the type
# of every path flag): every output check compares its target with all of them, and with the inputs a verb finds on
# the way (a recipe's files, given as `inputs`), so that no verb lists its flags and a new input flag is never missed.
_INPUTS: list[Path] = []


def note_input(path: Path | str) -> None:
    """`path` is an input of the command being run: no output of it may replace it (or, a directory, a file in it)."""
    if str(path).strip():
        _INPUTS.append(Path(path).expanduser())


@contextmanager
def command_inputs() -> Iterator[None]:
    """The inputs of one command: none on entry (its command line then registers them), none left on exit."""
    _INPUTS.clear()
    try:
        yield
    finally:
        _INPUTS.clear()


def _resolved(path: Path | str, flag: str) -> Path:
    if str(path).strip() == "":
        raise UserInputError(flag, "is empty; give a path")
    return Path(path).expanduser().resolve()


def not_a_link(path: Path | str, flag: str, fix: str) -> None:
    """An output named by a symbolic link is refused: writing it would write through the link to wherever it points
    (another user's file, another directory), which the name given does not say. A link among the directories above
    it (a scratch directory linked into a home) is the user's layout and is followed."""
    given = Path(path).expanduser()
    if given.is_symlink():
        try:
            points = os.readlink(given)
        except OSError:
            points = "?"
        raise UserInputError(flag, f"{path} is a symbolic link (to {points}); an output is never written through a "
                                   f"link: {fix}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return False


def input_at(target: Path, inputs: Iterable[Path | None] = (), inside: bool = True) -> Path | None:
    """The input of this command (`inputs` and every registered one) that writing `target` would replace: the same
    file, any symlink followed; with `inside`, also an input directory holding `target` when `target` already exists
    (a run or checkpoint directory stands for every file in it). None when writing `target` replaces no input."""
    target = Path(target)
    for source in dict.fromkeys([*(Path(p).expanduser() for p in inputs if p is not None), *_INPUTS]):
        if _same_file(target, source):
            return source
        try:
            if inside and target.exists() and source.is_dir() and target.resolve().is_relative_to(source.resolve()):
                return source
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
            continue
    return None


def _refuse_input(target: Path, flag: str, inputs: Iterable[Path | None] = (), inside: bool = True) -> None:
    source = input_at(target, inputs, inside)
    if source is not None:
        given = "" if source.absolute() == target.absolute() else f" ({source})"  # as the command line named it
        where = given if _same_file(target, source) else f" (in {source})"
        raise UserInputError(flag, f"{target} is an input of this command{where}; write somewhere else")


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
    """A file a command will write: not a link, not a directory, not one of its inputs, in an existing directory it
    can write."""
    target = _resolved(path, flag)
    if suffix is not None and target.suffix.lower() != suffix:
        raise UserInputError(flag, f"expects a {suffix} file name, got {path}")
    if target.is_dir():
        raise UserInputError(flag, f"{target} is a directory; give a file name")
    _refuse_input(target, flag, inputs)  # first: a link to an input is refused as what it would replace
    not_a_link(path, flag, "name the file itself or another name")
    if not target.parent.exists():
        raise UserInputError(flag, f"directory {target.parent} does not exist")
    _writable_directory(target.parent, flag, target)
    return target


def output_directory(path: Path | str, flag: str, inputs: Iterable[Path] = (), names: Iterable[str] = ()) -> Path:
    """A directory a command will create or write into: not a file, not an input, creatable; none of the `names` it
    will write into it (an input inside it, or inside an input directory, by one of those names) is an input. A link
    to an existing directory is that directory; a dangling one is refused (it would create a directory elsewhere)."""
    target = _resolved(path, flag)
    if not os.path.isdir(Path(path).expanduser()):
        not_a_link(path, flag, "give a real directory")
    if target.exists() and not target.is_dir():
        raise UserInputError(flag, f"{target} is a file; give a directory")
    inputs = list(inputs)
    _refuse_input(target, flag, inputs, inside=False)  # a new directory inside an input one replaces nothing
    for name in names:
        _refuse_input(target / name, flag, inputs)
    _writable_directory(target, flag, target)
    return target


def write_file(path: Path, data: str | bytes, flag: str, mode: int | None = None) -> None:
    """Write `data` to a temporary sibling, fsync, then rename over `path`: readers see the old file or the new one;
    a failure (a read-only file system, a full disk) is one line naming `flag`, with nothing left behind. The last
    guard: never over an input file of the command itself (a run's own files in its directory are written, read and
    rewritten by training: the directory rule is output_file's)."""
    path = Path(path)
    _refuse_input(path, flag, inside=False)
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


RECORD = ".dmt-generated.json"  # the files `dmt generate` wrote into a directory, with the sha256 of each
_RECORD_WHAT = "the record `dmt generate` keeps there: a JSON object of file name -> sha256"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _record(directory: Path, flag: str) -> dict[str, str]:
    """The record in `directory` ({} without one). One that is not such a record is one line, before anything is
    written or removed: a file in the directory is never taken for this tool's on the word of a damaged record."""
    path = directory / RECORD
    fix = f"; move it away (every file in {directory} is then taken for the user's: kept, replaced only with --force)"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise UserInputError(flag, f"cannot read {path} ({exc.strerror or exc}){fix}") from None
    if not stat.S_ISREG(mode):  # generate writes a regular file; a link or a FIFO is someone else's
        raise UserInputError(flag, f"{path} is not a regular file; expected {_RECORD_WHAT}{fix}")
    try:
        data = read_json(path, flag, what=_RECORD_WHAT)
    except UserInputError as exc:
        raise UserInputError(flag, exc.message + fix) from None
    bad = next((f"{name!r}: {digest!r}" for name, digest in data.items()
                if not (isinstance(digest, str) and _SHA256.fullmatch(digest))), None)
    if bad is not None:
        raise UserInputError(flag, f"{path} holds {bad[:80]}, not a sha256; expected {_RECORD_WHAT}{fix}")
    return data


def _ours(directory: Path, name: str, digest: str, names: frozenset[str]) -> bool:
    """Whether `directory/name` is a file this tool wrote and nobody changed since: a name its generators write (a
    plain name: directly inside `directory`, never through `..`, a separator or an absolute path), a regular file
    there (a symlink is not followed), whose content still has the recorded sha256."""
    if name not in names or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
        return False
    try:
        handle = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # absent, a symlink (ELOOP), unreadable
        return False
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return False
        with os.fdopen(os.dup(handle), "rb") as stream:  # hashed in chunks: a huge replacement costs time, not memory
            return hashlib.file_digest(stream, "sha256").hexdigest() == digest
    except OSError:
        return False
    finally:
        os.close(handle)


def write_generated(directory: Path, contents: dict[str, str], flag: str, names: Iterable[str],
                    inputs: Iterable[Path] = (), force: bool = False, executable: Iterable[str] = ()) -> list[Path]:
    """Write a set of generated files into `directory` together. `names`: every file name the caller's generators
    can write, the only names its record is trusted with. Every target is checked first: none may be a directory, a
    link or an input; a file there that this tool did not write (or that was edited since) is replaced only with
    `force`. Files are staged in a sibling directory and moved in. A file the record lists that the new set no longer
    has (another backend's) is removed only when it is one of `names`, directly in `directory`, a regular file with the
    content it was written with, and no input; anything else the record lists stays, with or without `force`."""
    names = frozenset(names)
    if not set(contents) <= names:
        raise ValueError(f"generated names not declared: {sorted(set(contents) - names)}")
    inputs = [Path(p) for p in inputs]
    directory = output_directory(directory, flag, inputs, names=contents)
    record = _record(directory, flag) if directory.is_dir() else {}
    ours = {name for name, digest in record.items() if _ours(directory, name, digest, names)}
    stale = [directory / name for name in sorted(ours - set(contents)) if input_at(directory / name, inputs) is None]
    for name in contents:
        target = directory / name
        if target.is_dir() or target.is_symlink():
            raise UserInputError(flag, f"{target} is a {'directory' if target.is_dir() else 'link'}; move it away or "
                                       f"choose another {flag}")
    if not force:
        foreign = [directory / n for n in contents if (directory / n).exists() and n not in ours]
        if foreign:
            listed = ", ".join(p.name for p in foreign)
            raise UserInputError(flag, f"{directory} holds {listed}, not written by this tool (or edited since); "
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


# The writer rule of generated files: a value becomes one word of a file, never a line, a flag or several words of its
# own. JSON and YAML are written by their dumpers and shell scripts with shlex.quote, which carry any value; a file
# read by a shell's word splitting (megatron_args.txt, used as `$(grep -v '^#' megatron_args.txt)`) has no quoting at
# all: blanks and line breaks split it into words and * ? [ expand as file-name patterns there, and a word starting
# with `-` (other than a negative number) reads as a flag. Such values are refused, naming their key.
_PATTERN_CHARACTERS = frozenset("*?[")


def word_problem(text: str) -> str | None:
    """Why `text` cannot be one word of a generated file that a shell splits into words, or None."""
    bad = next((c for c in text if c.isspace() or not c.isprintable() or c in _PATTERN_CHARACTERS), None)
    if bad is not None:
        return (f"{text[:80]!r} holds {bad!r}, which would split or expand the line of a generated file it is "
                f"written on (megatron_args.txt): no blanks, line breaks, control characters or * ? [ in it")
    if not text:
        return "is empty, which would be no word of the generated file (megatron_args.txt) it is written into"
    if text.startswith("-") and not text[1:2].isdigit():
        return (f"{text[:80]!r} would read as a flag of its own in a generated file (megatron_args.txt): a value "
                f"may not be empty or start with '-' (write ./{text[:80]} for a path)")
    return None


def one_word(text: str, key: str) -> str:
    """`text` when it can be one word of a generated file (word_problem), else one line naming `key`."""
    problem = word_problem(text)
    if problem is not None:
        raise UserInputError(key, problem)
    return text
