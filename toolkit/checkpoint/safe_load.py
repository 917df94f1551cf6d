"""The one way the toolkit unpickles what a checkpoint holds: only the classes its format needs, anything else refused
in one line naming the class, before it runs.

A pickle names the functions and classes it calls (its "globals"); unpickled without restriction, a crafted one calls
os.system as easily as torch.Size. Every pickle the toolkit opens passes through here:

- a DCP `.metadata` or a rank's `__<rank>.metadata` (plain pickles, which torch's FileSystemReader unpickles
  unrestricted): read_dcp_metadata, with
  RestrictedUnpickler and DCP_METADATA;
- a torch.save archive indexed without loading its tensors (DeepSpeed's rank files, Megatron's common.pt, an object
  stored in a DCP file): torch_zip.index_torch_file, whose unpickler is a RestrictedUnpickler of DEEPSPEED or
  STORED_OBJECT;
- a torch.save archive whose tensors are loaded (a DCP chunk, a stored object scanned by `verify --deep`): torch_load,
  i.e. torch.load(weights_only=True), torch's own restricted unpickler;
- a directory handed to a library's loader that unpickles unrestricted (DCP's FileSystemReader and load_bytes under
  Megatron-Core's dist_checkpointing.load and Accelerate's FSDP resume, DeepSpeed's torch.load(weights_only=False)
  and ds_to_universal under a resume) or with torch's weights_only, whose refusal is a traceback (HF Trainer's
  rng_state, scheduler, optimizer): check_checkpoint, every one of those pickles first, here, after every file the
  loaders open is known to be a regular file inside the checkpoint (and `dmt ckpt verify` reports each fault);
- Megatron-Core's dataset index cache, which GPTDataset and BlendedDataset read with numpy.load(allow_pickle=True):
  toolkit/data/indexed.check_plain_arrays refuses an object array from numpy's header, unread (it sits in the data
  layer, below this package, as training's data path must not import checkpoint code).

The allow-lists and the restricted unpickler are in toolkit/checkpoint/allow_lists.py.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from pathlib import Path

from toolkit.checkpoint.allow_lists import (
    DCP_METADATA,
    STORED_OBJECT,
    TENSORS,
    TORCH_FILES,
    Refused,
    RestrictedUnpickler,
    refusal,
)
from toolkit.checkpoint.torch_zip import check_stored, index_torch_file
from toolkit.compat.torch_seams import is_storage_entry
from toolkit.errors import UserInputError
from toolkit.readers import inside, link_root, not_a_file, one_line, open_regular, problem, read_text


def read_dcp_metadata(checkpoint: Path, key: str | None = None, name: str = ".metadata"):
    """The `.metadata` of a torch.distributed.checkpoint directory (or its rank-local `__<rank>.metadata`, `name`):
    every tensor's global shape and chunks, and where each chunk is stored. Unpickled with DCP_METADATA only (torch's
    FileSystemReader.read_metadata would run any pickle); a damaged or foreign file is a UserInputError naming it."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(checkpoint) / name
    what = "torch.distributed.checkpoint metadata (a pickled Metadata, as dcp.save writes it)"
    try:
        with open_regular(path, key or str(path), what) as handle:
            # not a pickle at all: refused without unpickling (random bytes can make pickle allocate wildly and
            # CPython print errors of its own on the way out)
            head = handle.read(2)
            if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:
                raise UserInputError(key or str(path), f"{path} does not start as a pickle (protocol 2-5) does; "
                                                       f"expected {what}")
            handle.seek(0)
            metadata = RestrictedUnpickler(handle, DCP_METADATA).load()
    except UserInputError:
        raise
    except Refused as exc:
        raise refusal(path, key, exc.name, exc.allowed) from None
    except FileNotFoundError:
        raise UserInputError(key or str(path), f"{path} does not exist; expected {what}") from None
    except Exception as exc:  # unpickling damaged bytes can raise almost any exception type
        raise UserInputError(key or str(path), f"{path} cannot be read ({type(exc).__name__}: {one_line(exc)[:200]}); "
                                               f"expected {what}") from None
    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)):
        raise UserInputError(key or str(path), f"{path} holds a {type(metadata).__name__}; expected {what}")
    check_storage_paths(Path(checkpoint), metadata, key)
    return metadata


def check_storage_paths(checkpoint: Path, metadata, key: str | None) -> None:
    """Every file a DCP `.metadata` names for its chunks, checked before anything reads one (torch's FileSystemReader
    opens `checkpoint / relative_path` as given and reads `length` bytes at `offset`): a relative path that stays
    inside the checkpoint, symlinks resolved, to a regular file or to nothing (a missing file is the format checks'
    to report), with a plain offset and length. A FIFO there would block every reader, /dev/zero would be read for
    as long as the metadata says, `../` would read another directory's files."""
    what = "a storage file of this checkpoint (a path inside it, as dcp.save writes __<rank>_<n>.distcp)"
    named = set()
    for index, info in metadata.storage_data.items():
        if not (is_storage_entry(info) and isinstance(info.relative_path, str)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (info.offset, info.length))):
            raise problem(checkpoint / ".metadata", key, f"stores {getattr(index, 'fqn', index)!r} at "
                                                         f"{str(info)[:200]}; expected a relative path, an offset and "
                                                         f"a length of {what}")
        if info.relative_path in named:
            continue
        named.add(info.relative_path)
        file = inside(checkpoint, info.relative_path, key, what, follow=False)
        if not_a_file(file) is not None:
            raise problem(file, key, f"is {not_a_file(file)}, not a regular file; expected {what}")
        inside(checkpoint, info.relative_path, key, what)


RANK_METADATA = "__*.metadata"  # a rank's own metadata (FileSystemReader.read_metadata(rank=...))


# how torch.load(weights_only=True) names the global it refused (torch/_weights_only_unpickler.py)
_TORCH_REFUSAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


def torch_load(source, path: Path, key: str | None = None):
    """torch.load of a torch.save archive (a file or a file-like slice of one) with torch's restricted unpickler
    (weights_only=True: tensors, containers, plain values); a global it refuses is this module's refusal."""
    import zipfile

    import torch

    try:
        try:
            with zipfile.ZipFile(source) as archive:  # torch's reader would inflate a compressed record whole
                check_stored(archive, path, key)
        except zipfile.BadZipFile as exc:  # as torch's own reader says it
            raise RuntimeError(f"not a torch.save archive ({exc})") from None
        source.seek(0)
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        asked = _TORCH_REFUSAL.search(str(exc))
        if asked:  # torch names builtins without their module
            name = asked.group(1) if "." in asked.group(1) else f"builtins.{asked.group(1)}"
            raise refusal(path, key, name, TENSORS) from None
        raise


def check_checkpoint(ckpt: Path, key: str | None) -> None:
    """Checkpoint directory `ckpt` made safe to hand to a library's loader: every file in it regular and inside it
    (path_faults), and every pickle a loader unpickles (without restriction, or torch's weights_only that ends in a
    traceback) passed through the allow-lists here first (nothing in it is run). The first fault is raised."""
    for fault in path_faults(ckpt, key):
        raise fault
    for fault in pickle_faults(ckpt, key):
        raise fault


def path_faults(ckpt: Path, key: str | None) -> Iterator[UserInputError]:
    """Each entry of `ckpt` a loader could open that would block it, read without end or lead outside: a FIFO, a
    device or a socket (a symlink judged by its target), a symlink resolving outside `ckpt` (a file's may resolve
    into the hub cache's repository, link_root; a directory's only inside `ckpt`, where the walk below and
    pickle_faults' see what it holds: they do not enter a symlinked directory), a `latest` pointer naming anything
    but a directory beside it. The libraries' loaders (DeepSpeed's, Accelerate's, Megatron-Core's, HF Trainer's json
    and torch.load) open what they find as given."""
    import os

    ckpt = Path(ckpt)
    root = link_root(ckpt)  # an HF snapshot in the hub's cache links its files into the repository's blobs/
    what = "a regular file inside the checkpoint"
    for folder, dirs, files in os.walk(ckpt):  # symlinked directories are listed, not entered
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]):
            path = Path(folder) / name
            try:
                kind = not_a_file(path)
                if kind is not None and not path.is_dir():
                    raise problem(path, key, f"is {kind}, not a regular file; expected {what}")
                within = ckpt if path.is_dir() else root  # the hub links files only
                inside(within, path.relative_to(within), key, what)
                if name == "latest" and kind is None:
                    inside(path.parent, read_text(path, key, "the name of a tag directory beside it").strip(), key,
                           "the name of a tag directory beside it")
            except UserInputError as exc:
                yield exc


def pickle_faults(ckpt: Path, key: str | None) -> Iterator[UserInputError]:
    """The pickles check_checkpoint reads, each refused or unreadable one as the UserInputError naming it: the DCP
    directories' (Megatron-Core's, FSDP2's model and optimizer) `.metadata` and every object they store, and the
    TORCH_FILES (DeepSpeed's rank files, Megatron-Core's common.pt, HF Trainer's state files). Only the pickles are
    read, never the tensor data."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    ckpt = Path(ckpt)
    archives = []  # (file, its region or None for the whole file, allow-list) of every torch.save archive
    # torch's DCP loader reads a rank's `__<rank>.metadata` (with plain pickle.load) when `.metadata` is missing or
    # unreadable: every one is read here too
    for marker in sorted({*ckpt.rglob(".metadata"), *ckpt.rglob(RANK_METADATA)}):
        try:
            metadata = read_dcp_metadata(marker.parent, key, marker.name)
        except UserInputError as exc:
            yield exc
            continue
        archives += [(marker.parent / info.relative_path, (info.offset, info.length), STORED_OBJECT, marker.parent)
                     for index, info in metadata.storage_data.items()
                     if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)]
    for pattern, allowed in TORCH_FILES.items():
        archives += [(file, None, allowed, ckpt) for file in sorted(ckpt.rglob(pattern))]
    for file, region, allowed, root in archives:
        try:
            index_torch_file(file, region, allowed, key, root)
        except UserInputError as exc:
            yield exc

