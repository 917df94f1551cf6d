"""The one reader per file format: any read, decode or shape error becomes one UserInputError line naming the
file and what was expected, never a traceback."""

from __future__ import annotations

import functools
import json
import os
import stat
from pathlib import Path
from typing import Any

from toolkit.errors import UserInputError
from toolkit.numeric import NOT_FINITE, non_finite


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (YAML and validation errors span several, with carets)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def problem(path: Path | str, key: str | None, message: str) -> UserInputError:
    """One line naming the file: `KEY: PATH <message>`, or `PATH: <message>` when no flag names it."""
    return UserInputError(key, f"{path} {message}") if key else UserInputError(str(path), message)


# The most bytes one file of each format may hold; read_text refuses a larger one before reading it, and reads at most
# this much plus one byte (a file that grows meanwhile is refused too), once. Configs (recipes, HF config.json,
# DeepSpeed JSON, accelerate/megatron YAML, calibration, health reports, manifests, run_plan.json, plan.json) are
# kilobytes: the largest real one, a 1T-parameter model's safetensors index, is about 2 MiB. metrics.jsonl holds
# about 0.5 KiB per logged step (a few KiB with per-rank memory lists): 1 GiB is a million logged steps of any run.
SIZE_LIMITS = {"text": 16 * 2**20, "json": 16 * 2**20, "yaml": 16 * 2**20, "jsonl": 2**30}
# The deepest nesting of a JSON or YAML document (configs nest under ten levels; Python's parsers recurse per level
# and the toolkit walks what they return, so this stays well under the interpreter's recursion limit of 1000)
MAX_DEPTH = 100
# The most values (scalars, lists, mappings) a YAML document may expand to, each alias counted as the values it
# stands for: a kilobyte of nested aliases ("billion laughs") otherwise becomes gigabytes once written out as JSON
MAX_YAML_VALUES = 1_000_000

_FILE_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def _size(limit: int) -> str:
    return f"{limit // 2**30} GiB" if limit >= 2**30 else f"{limit // 2**20} MiB"


def not_a_file(path: Path) -> str | None:
    """What `path` is when it is there but no regular file (a symlink judged by its target), e.g. 'a FIFO (named
    pipe)'; None for a regular file or nothing there. Reads nothing and never blocks."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symlink" if os.path.islink(path) else None
    except OSError:
        return None  # not reachable: reading it says why
    return None if stat.S_ISREG(mode) else _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")


def link_root(directory: Path) -> Path:
    """The folder a model directory's symlinks may lead into: the directory itself, or, for a snapshot in the
    Hugging Face hub's cache (<cache>/models--<org>--<name>/snapshots/<revision>/, whose files link to
    ../../blobs/<hash>), that repository's folder. Every verb that reads a model directory confines its links to it,
    so `ckpt verify`, `ckpt inspect` and the converters agree on what is inside."""
    directory = Path(directory)
    repo = directory.parent.parent
    if (directory.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--"))
            and (repo / "blobs").is_dir()):
        return repo
    return directory


def inside(root: Path, name: str | Path, key: str | None, what: str, follow: bool = True) -> Path:
    """`root / name` for a `name` that a file inside `root` gave (a checkpoint's metadata, its `latest` pointer): a
    relative path without `..` that, symlinks resolved (unless `follow=False`: an HF model directory in the hub's
    cache links every file to ../../blobs), stays inside `root`. Anything else is one line naming `key` (or the path)
    and where it leads; nothing is opened."""
    root, text = Path(root), str(name)
    path = root / text
    if not text or "\0" in text or Path(text).is_absolute() or ".." in Path(text).parts:
        raise UserInputError(key or str(root), f"{text!r} leads outside {root} (only paths inside it are read); "
                                               f"expected {what}")
    if follow:
        try:
            outside = not path.resolve().is_relative_to(root.resolve())
        except (OSError, RuntimeError):  # a symlink loop: nothing there to read
            outside = False
        if outside:
            raise problem(path, key, f"resolves to {path.resolve()}, outside {root} (only files inside it are read); "
                                     f"expected {what}")
    return path


def open_regular(path: Path, key: str | None = None, what: str = "a file", root: Path | None = None,
                 end: int | None = None):
    """The one way a file named by something from elsewhere is opened: a binary file object over a regular file (a
    symlink judged by its target), inside `root` after resolving symlinks when `root` is given, at least `end` bytes
    long when the caller's format records how far it reads. A FIFO, a device, a socket is refused before it is opened
    for reading, and the open itself never waits (O_NONBLOCK); callers read no more than the sizes their format
    records (read_bytes: its kind's limit; a checkpoint's reader: the offset and length its metadata gives)."""
    path = Path(path)
    name = path.relative_to(root) if root is not None and path.is_relative_to(root) else path
    if root is not None:
        inside(root, name, key, what, follow=False)
    if not_a_file(path) is not None:  # what it is says more than where it leads
        raise problem(path, key, f"is {not_a_file(path)}, not a regular file; expected {what}")
    if root is not None:
        inside(root, name, key, what)
    try:
        # O_NONBLOCK: should a FIFO replace the file between the stat and the open, the open does not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise problem(path, key, f"does not exist; expected {what}") from None
    except OSError as exc:
        raise problem(path, key, f"cannot be read ({exc.strerror or one_line(exc)}); expected {what}") from None
    handle = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        handle.close()
        raise problem(path, key, f"is {_FILE_KINDS.get(stat.S_IFMT(info.st_mode), 'not a regular file')}, "
                                 f"not a regular file; expected {what}")
    if end is not None and info.st_size < end:
        handle.close()
        raise problem(path, key, f"holds {info.st_size} bytes, fewer than the {end} its checkpoint records "
                                 f"(truncated); expected {what}")
    return handle


def read_bytes(path: Path, key: str | None = None, what: str = "a file", kind: str = "text") -> bytes:
    """The bytes of a regular file of at most SIZE_LIMITS[kind] bytes, read once. A FIFO, a device, a socket (a
    symlink judged by its target) is refused before it is opened for reading, so that nothing blocks or reads for
    ever; `key` names the flag or setting that gave the path (the path itself names it otherwise)."""
    path, limit = Path(path), SIZE_LIMITS[kind]
    with open_regular(path, key, what) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise problem(path, key, f"holds {size} bytes, more than the {_size(limit)} {kind} files may "
                                     f"hold; expected {what}")
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            raise problem(path, key, f"cannot be read ({exc.strerror or one_line(exc)}); expected {what}") from None
    if len(data) > limit:
        raise problem(path, key, f"grew past the {_size(limit)} {kind} files may hold while read; expected {what}")
    return data


def read_text(path: Path, key: str | None = None, what: str = "a text file", kind: str = "text") -> str:
    """UTF-8 text of a regular file of at most SIZE_LIMITS[kind] bytes (see read_bytes); newlines as text mode
    reads them."""
    data = read_bytes(path, key, what, kind)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise problem(Path(path), key, f"is not UTF-8 text; expected {what}") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as open() in text mode reads it


def _shape(data: Any, path: Path | str, key: str | None, expect: type | None, what: str) -> Any:
    if expect is not None and not isinstance(data, expect):
        found = "nothing" if data is None else f"a {type(data).__name__}"
        raise problem(path, key, f"holds {found} at the top level; expected {what}")
    return data


def _finite(data: Any, path: Path | str, key: str | None, what: str) -> Any:
    """JSON's NaN and Infinity tokens (Python's json reads them), 1e999 (read as inf) and YAML's .nan and .inf are
    refused here, naming where in the file, so no reader downstream ever sees one."""
    found = non_finite(data)
    if found is not None:
        raise problem(path, key, f"holds {found[1]} at {found[0]}, {NOT_FINITE}; expected {what}")
    return data


_TOO_DEEP = object()  # parse_json's mark for a document its parser could not descend


class DuplicateKey(ValueError):
    """A mapping that names one key twice; its message says which (and, in YAML, on which lines)."""


def unique_keys(pairs: list[tuple[Any, Any]]) -> dict:
    """json.loads' object_pairs_hook: the object, or DuplicateKey for a key given twice. Python's json (like YAML's
    loader) keeps the last silently, so `{"stage": 3, ..., "stage": 0}` would quietly mean something its writer may
    not have meant; every JSON and YAML file the toolkit reads refuses it instead, naming the key."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise DuplicateKey(f"holds the key {twice!r} twice in one object, of which only one would be used")
    return data


def _too_deep(data: Any) -> bool:
    """Whether parsed JSON nests deeper than MAX_DEPTH (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > MAX_DEPTH:
                    return True
                stack.append((child, depth + 1))
    return False


def parse_json(text: str | bytes, source: Path | str, key: str | None = None, expect: type | None = dict,
               what: str = "a JSON object", finite: bool = True) -> Any:
    """A JSON document (text already read, e.g. a request body) nested at most MAX_DEPTH deep, whose top level is
    `expect`, every number finite unless `finite=False` (a file another library writes with NaN in it on purpose);
    `source` names where it came from."""
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        raise problem(source, key, f"{exc}; expected {what} with each key once") from None
    except json.JSONDecodeError as exc:
        raise problem(source, key, f"is not valid JSON ({exc.msg} at line {exc.lineno}); expected {what}") from None
    except UnicodeDecodeError:
        raise problem(source, key, f"is not UTF-8 text; expected {what}") from None
    except ValueError as exc:  # json.loads' own limit: an integer of more than 4300 digits
        raise problem(source, key, f"holds a value that cannot be read ({one_line(exc)[:200]}); expected {what}") \
            from None
    except RecursionError:  # its parser recurses once per level: nesting in the thousands
        data = _TOO_DEEP
    if data is _TOO_DEEP or _too_deep(data):
        raise problem(source, key, f"nests deeper than {MAX_DEPTH} levels; expected {what}")
    data = _shape(data, source, key, expect, what)
    return _finite(data, source, key, what) if finite else data


def read_json(path: Path, key: str | None = None, expect: type | None = dict, what: str = "a JSON object",
              finite: bool = True) -> Any:
    """A JSON document whose top level is `expect` (dict by default; None: anything); see parse_json."""
    return parse_json(read_text(path, key, what, "json"), Path(path), key, expect, what, finite)


def read_json_lines(path: Path, key: str | None = None, expect: type | None = dict,
                    what: str = "JSON lines") -> list:
    """One JSON document per line (blank lines skipped), each `expect` at its top level; a last line without its
    newline was cut short by a writer killed mid-write and is no record."""
    text = read_text(path, key, what, "jsonl")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines = lines[:-1]
    return [parse_json(line, f"{path} line {number}", key, expect, what)
            for number, line in enumerate(lines, 1) if line.strip()]


class BoundExceeded(Exception):
    """A document past MAX_DEPTH or MAX_YAML_VALUES; its message says which."""


@functools.cache
def bounded_yaml_loader() -> type:
    """yaml.SafeLoader that measures each node as it is composed (before anything is built from it): nesting past
    MAX_DEPTH, more than MAX_YAML_VALUES values with every alias counted as what it stands for, or an alias inside
    its own anchor (a structure that contains itself) raise BoundExceeded. Made on first use: only the verbs that
    read YAML import yaml."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        def __init__(self, stream):
            super().__init__(stream)
            self.values = 0
            self.heights = [0]  # per node being composed (the document first): the height of its tallest child yet
            self.measured: dict[str, tuple[int, int]] = {}  # anchor -> (values, height) of its node, once composed

        def grow(self, values: int, height: int) -> None:
            self.values += values
            self.heights[-1] = max(self.heights[-1], height)
            if self.values > MAX_YAML_VALUES:
                raise BoundExceeded(f"expands to more than {MAX_YAML_VALUES} values with its aliases (an alias bomb)")
            if len(self.heights) - 1 + height > MAX_DEPTH:
                raise BoundExceeded(f"nests deeper than {MAX_DEPTH} levels")

        def construct_mapping(self, node, deep=False):
            """Refuses a key given twice in one mapping (yaml keeps the last silently); keys a merge (`<<: *base`)
            brings in may be overridden, as YAML's merge means."""
            if isinstance(node, yaml.MappingNode):
                lines: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    name, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                    try:
                        if name in lines:
                            raise DuplicateKey(f"holds the key {name!r} twice in one mapping (lines {lines[name]} "
                                               f"and {line}), of which only one would be used")
                        lines[name] = line
                    except TypeError:  # an unhashable key: yaml's own error says so
                        continue
            return super().construct_mapping(node, deep=deep)

        def compose_node(self, parent, index):
            anchor = self.peek_event().anchor
            if self.check_event(yaml.AliasEvent):
                if anchor in self.anchors and anchor not in self.measured:
                    raise BoundExceeded(f"uses the alias *{anchor} inside its own anchor (a structure that contains "
                                        f"itself)")
                node = super().compose_node(parent, index)  # an unknown alias: yaml's own error
                self.grow(*self.measured[anchor])
                return node
            if len(self.heights) > MAX_DEPTH:  # before composing it: yaml's composer recurses once per level
                raise BoundExceeded(f"nests deeper than {MAX_DEPTH} levels")
            before = self.values
            self.heights.append(0)
            node = super().compose_node(parent, index)
            height = self.heights.pop() + 1
            self.grow(1, height)
            if anchor is not None:
                self.measured[anchor] = (self.values - before, height)
            return node

    return BoundedLoader


def read_yaml(path: Path, key: str | None = None, expect: type | None = dict, what: str = "a YAML mapping") -> Any:
    """A YAML document whose top level is `expect` (dict by default; None: anything), read by bounded_yaml_loader."""
    path = Path(path)
    return parse_yaml(read_text(path, key, what, "yaml"), path, key, expect, what)


def parse_yaml(text: str, source: Path | str, key: str | None = None, expect: type | None = dict,
               what: str = "a YAML mapping") -> Any:
    """A YAML document given as text (an upload, or a file read_yaml read), read by bounded_yaml_loader; `source`
    names it in errors."""
    data = _load_yaml(text, source, key, what, lambda loader: loader.get_single_data())
    return _finite(_shape(data, source, key, expect, what), source, key, what)


def parse_yaml_documents(text: str, source: Path | str, key: str | None = None,
                         what: str = "YAML mappings") -> list[dict]:
    """Every document of a YAML stream (`---` between them: a Kubernetes manifest), each a mapping, read by
    bounded_yaml_loader with its bounds over the whole stream; empty documents between `---`s are skipped."""

    def every(loader) -> list:
        documents = []
        while loader.check_data():
            documents.append(loader.get_data())
        return [document for document in documents if document is not None]

    documents = _load_yaml(text, source, key, what, every)
    if not documents:
        raise problem(source, key, f"is empty; expected {what}")
    return [_finite(_shape(document, source, key, dict, what), source, key, what) for document in documents]


def _load_yaml(text: str, source: Path | str, key: str | None, what: str, read) -> Any:
    """`read(loader)` on a bounded loader over `text`: what goes wrong is one problem naming `source`."""
    import yaml

    loader = None
    try:
        loader = bounded_yaml_loader()(text)  # its reader refuses control characters already here
        return read(loader)
    except BoundExceeded as exc:
        raise problem(source, key, f"{exc}; expected {what}") from None
    except DuplicateKey as exc:
        raise problem(source, key, f"{exc}; expected {what} with each key once") from None
    except yaml.YAMLError as exc:
        raise problem(source, key, f"is not valid YAML ({one_line(exc)}); expected {what}") from None
    except ValueError as exc:  # a value yaml resolves but Python refuses: an integer of more than 4300 digits
        raise problem(source, key, f"holds a value that cannot be read ({one_line(exc)[:200]}); expected {what}") \
            from None
    finally:
        if loader is not None:
            loader.dispose()

# safetensors (its docs, "Format"): an 8-byte little-endian header length, a JSON header mapping each tensor name to
# dtype, shape and [begin, end) offsets into the data that follows; safetensors itself refuses headers over 100 MB
SAFETENSORS_HEADER_LIMIT = 100_000_000


def read_safetensors_header(path: Path, key: str | None = None) -> dict[str, dict]:
    """The tensors of a safetensors file, name -> {"dtype", "shape", "data_offsets"}, checked to lie inside the
    file (so that safetensors' own reader can then map them); `__metadata__` is left out."""
    import struct

    path = Path(path)
    what = "a safetensors file (8-byte header length, JSON header, tensor data)"
    fault = key or str(path)
    try:
        with open_regular(path, fault, what) as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if not 2 <= length <= min(size - 8, SAFETENSORS_HEADER_LIMIT):
                raise UserInputError(fault, f"{path} has no valid header ({size} bytes, header length "
                                            f"{length}); expected {what}")
            text = handle.read(length)
    except OSError as exc:
        raise UserInputError(fault, f"cannot read {path} ({exc.strerror or one_line(exc)}); expected {what}") from None
    try:
        header = json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        raise UserInputError(fault, f"{path}: its header {exc}; expected {what}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserInputError(fault, f"{path}: its header is not JSON; expected {what}") from None
    if not isinstance(header, dict):
        raise UserInputError(fault, f"{path}: its header is not a JSON object; expected {what}")
    data = size - 8 - length
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in tensors.items():
        if not _safetensors_entry_fits(entry, data):
            raise UserInputError(fault, f"{path}: header entry {name!r} is not a dtype, shape and offsets inside "
                                        f"the file's {data} data bytes (truncated or corrupt); expected {what}")
    return tensors


def _safetensors_entry_fits(entry: Any, data_bytes: int) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes)
