"""The one way the toolkit unpickles what a checkpoint holds: only the classes its format needs, anything else refused
in one line naming the class, before it runs.

A pickle names the functions and classes it calls (its "globals"); unpickled without restriction, a crafted one calls
os.system as easily as torch.Size. Every pickle the toolkit opens passes through here:

- a DCP `.metadata` (a plain pickle, which torch's FileSystemReader unpickles unrestricted): read_dcp_metadata, with
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

The allow-lists are what the real libraries write (found with torch's get_unsafe_globals_in_checkpoint and the
globals of checkpoints saved by DeepSpeed 0.19, Megatron-Core 0.16 (its converter's and its training's) and torch
2.13's DCP, FSDP2 through Accelerate).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from pathlib import Path

from toolkit.compat.stdlib_seams import python3_name
from toolkit.compat.torch_seams import PICKLED_DCP_METADATA, PICKLED_TENSOR_REBUILDERS
from toolkit.errors import UserInputError
from toolkit.readers import inside, not_a_file, one_line, open_regular, problem

# torch's legacy typed storage classes: what torch.save pickles as a storage's type
STORAGES = ("FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "IntStorage",
            "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage")
DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")
_TORCH_VALUES = frozenset({f"torch.{name}" for name in STORAGES + DTYPES} | {"torch.Size", "torch.device"})

# a torch.save archive of tensors in containers: torch's tensor and parameter rebuilders, Python's containers and the
# bytes encoding of pickle protocol 2 (what torch.save writes)
TENSORS = _TORCH_VALUES | set(PICKLED_TENSOR_REBUILDERS) | {
    "torch.Tensor", "collections.OrderedDict", "builtins.set", "builtins.frozenset", "_codecs.encode",
}
DCP_METADATA = _TORCH_VALUES | set(PICKLED_DCP_METADATA) | {
    *(f"torch.distributed.checkpoint.metadata.{name}" for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta")),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    # Megatron-Core's save planner keeps each rank's plan in the metadata (to reuse it on the next save)
    *(f"torch.distributed.checkpoint.planner.{name}" for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
    "pathlib.PosixPath",  # StorageMeta.checkpoint_id
    "collections.OrderedDict",
}
DEEPSPEED = TENSORS | {
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", "deepspeed.utils.tensor_fragment.fragment_address",
}
# Megatron-Core's common.pt and the objects a DCP checkpoint stores (RNG states, optimizer pieces): tensors, and the
# classes Megatron-Core itself allows torch.load (megatron/core/safe_globals.py)
STORED_OBJECT = TENSORS | {
    "argparse.Namespace", "types.SimpleNamespace", "pathlib.PosixPath", "io.BytesIO", "signal.Signals",
    "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.dtypes.UInt32DType", "megatron.core.enums.ModelType", "megatron.core.optimizer.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState", "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
}
# HF Trainer's own files of a checkpoint-N (rng_state*.pth, scheduler.pt, optimizer.pt, scaler.pt, pytorch_model.bin),
# which its resume torch.loads: tensors, and the numpy arrays of numpy's RNG state (transformers' safe_globals)
HF_TRAINER = TENSORS | {"numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                        "numpy._core.multiarray._reconstruct", "numpy.dtypes.UInt32DType"}
FORMATS = {DCP_METADATA: "torch.distributed.checkpoint metadata", DEEPSPEED: "a DeepSpeed checkpoint",
           STORED_OBJECT: "a Megatron-Core or DCP stored object", TENSORS: "a tensor file",
           HF_TRAINER: "an HF Trainer checkpoint's state file"}
# where each torch.save file a library's loader opens lies in a checkpoint, and its allow-list
TORCH_FILES = {"*_optim_states.pt": DEEPSPEED, "*_model_states.pt": DEEPSPEED, "common.pt": STORED_OBJECT,
               "rng_state*.pth": HF_TRAINER, "scheduler.pt": HF_TRAINER, "optimizer.pt": HF_TRAINER,
               "optimizer.bin": HF_TRAINER, "scaler.pt": HF_TRAINER, "pytorch_model*.bin": HF_TRAINER}


REFUSED = "refused without running it"  # how every refusal ends (verify tells refusals from damage by it)


class Refused(pickle.UnpicklingError):
    """A pickle asked for a global outside its format's allow-list; nothing it named was called."""

    def __init__(self, name: str, allowed: frozenset):
        self.name, self.allowed = name, allowed
        super().__init__(f"asks for {name}")


def refusal(path: Path, key: str | None, name: str, allowed: frozenset) -> UserInputError:
    """The one line: which file asked for which global, and that nothing ran."""
    return problem(Path(path), key, f"asks for {name} (not allowed in {FORMATS[allowed]}); {REFUSED}")


class RestrictedUnpickler(pickle.Unpickler):
    """pickle's Unpickler whose find_class (every global a pickle names passes through it, Python's documented way to
    restrict unpickling) resolves only the names of `allowed`."""

    def __init__(self, handle, allowed: frozenset):
        super().__init__(handle)
        self.allowed = allowed

    def check(self, module: str, name: str) -> tuple[str, str]:
        """(module, name) as Python 3 names it, when allowed; Refused otherwise."""
        # Python 2 names (__builtin__.exec: protocol 2, torch.save's) are checked as the Python 3 names pickle maps
        # them to (a protocol 3+ pickle naming one fails to import it)
        module, name = python3_name(module, name)
        if f"{module}.{name}" not in self.allowed:
            raise Refused(f"{module}.{name}", self.allowed)
        return module, name

    def find_class(self, module: str, name: str):
        return super().find_class(*self.check(module, name))


def read_dcp_metadata(checkpoint: Path, key: str | None = None):
    """The `.metadata` of a torch.distributed.checkpoint directory: every tensor's global shape and chunks, and where
    each chunk is stored. Unpickled with DCP_METADATA only (torch's FileSystemReader.read_metadata would run any
    pickle); a damaged or foreign file is a UserInputError naming it."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(checkpoint) / ".metadata"
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
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    what = "a storage file of this checkpoint (a path inside it, as dcp.save writes __<rank>_<n>.distcp)"
    named = set()
    for index, info in metadata.storage_data.items():
        if not (isinstance(info, _StorageInfo) and isinstance(info.relative_path, str)
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


# how torch.load(weights_only=True) names the global it refused (torch/_weights_only_unpickler.py)
_TORCH_REFUSAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


def torch_load(source, path: Path, key: str | None = None):
    """torch.load of a torch.save archive (a file or a file-like slice of one) with torch's restricted unpickler
    (weights_only=True: tensors, containers, plain values); a global it refuses is this module's refusal."""
    import zipfile

    import torch

    from toolkit.checkpoint.torch_zip import check_stored

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
    device or a socket (a symlink judged by its target), a symlink resolving outside `ckpt`, a `latest` pointer
    naming anything but a directory beside it. The libraries' loaders (DeepSpeed's, Accelerate's, Megatron-Core's,
    HF Trainer's json and torch.load) open what they find as given."""
    import os

    from toolkit.readers import read_text

    ckpt = Path(ckpt)
    what = "a regular file inside the checkpoint"
    for folder, dirs, files in os.walk(ckpt):  # symlinked directories are listed, not entered
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]):
            path = Path(folder) / name
            try:
                kind = not_a_file(path)
                if kind is not None and not path.is_dir():
                    raise problem(path, key, f"is {kind}, not a regular file; expected {what}")
                inside(ckpt, path.relative_to(ckpt), key, what)
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

    from toolkit.checkpoint.torch_zip import index_torch_file

    ckpt = Path(ckpt)
    archives = []  # (file, its region or None for the whole file, allow-list) of every torch.save archive
    for marker in sorted(ckpt.rglob(".metadata")):
        try:
            metadata = read_dcp_metadata(marker.parent, key)
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

