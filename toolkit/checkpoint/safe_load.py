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
  and ds_to_universal under a resume): check_checkpoint, every one of those pickles first, here (and `dmt ckpt
  verify` reports each one pickle_faults finds refused);
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
from toolkit.readers import one_line, problem

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
FORMATS = {DCP_METADATA: "torch.distributed.checkpoint metadata", DEEPSPEED: "a DeepSpeed checkpoint",
           STORED_OBJECT: "a Megatron-Core or DCP stored object", TENSORS: "a tensor file"}


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

    from toolkit.readers import not_a_file

    path = Path(checkpoint) / ".metadata"
    what = "torch.distributed.checkpoint metadata (a pickled Metadata, as dcp.save writes it)"
    if not_a_file(path):  # opening a FIFO would wait for a writer; /dev/zero would be read for ever
        raise UserInputError(key or str(path), f"{path} is {not_a_file(path)}, not a regular file; expected {what}")
    try:
        with open(path, "rb") as handle:  # not a pickle at all: refused without unpickling (random bytes can make
            head = handle.read(2)  # pickle allocate wildly and CPython print errors of its own on the way out)
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
    return metadata


# how torch.load(weights_only=True) names the global it refused (torch/_weights_only_unpickler.py)
_TORCH_REFUSAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


def torch_load(source, path: Path, key: str | None = None):
    """torch.load of a torch.save archive (a file or a file-like slice of one) with torch's restricted unpickler
    (weights_only=True: tensors, containers, plain values); a global it refuses is this module's refusal."""
    import torch

    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        asked = _TORCH_REFUSAL.search(str(exc))
        if asked:  # torch names builtins without their module
            name = asked.group(1) if "." in asked.group(1) else f"builtins.{asked.group(1)}"
            raise refusal(path, key, name, TENSORS) from None
        raise


def rank_file_format(path: Path) -> frozenset:
    """The allow-list of one torch.save file of a checkpoint: DeepSpeed's rank files, or a stored object."""
    return DEEPSPEED if path.name.endswith(("_optim_states.pt", "_model_states.pt")) else STORED_OBJECT


def check_checkpoint(ckpt: Path, key: str | None) -> None:
    """Every pickle of checkpoint directory `ckpt` that a library's own loader unpickles without restriction, passed
    through the allow-lists here first (nothing in it is run): the first refused or unreadable one is raised."""
    for fault in pickle_faults(ckpt, key):
        raise fault


def pickle_faults(ckpt: Path, key: str | None) -> Iterator[UserInputError]:
    """The pickles check_checkpoint reads, each refused or unreadable one as the UserInputError naming it: the DCP
    directories' (Megatron-Core's, FSDP2's model and optimizer) `.metadata` and every object they store, DeepSpeed's
    rank files, Megatron-Core's common.pt. Only the pickles are read, never the tensor data."""
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
        archives += [(marker.parent / info.relative_path, (info.offset, info.length), STORED_OBJECT)
                     for index, info in metadata.storage_data.items()
                     if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)]
    for pattern in ("*_optim_states.pt", "*_model_states.pt", "common.pt"):
        archives += [(file, None, rank_file_format(file)) for file in sorted(ckpt.rglob(pattern))]
    for file, region, allowed in archives:
        try:
            index_torch_file(file, region, allowed, key)
        except UserInputError as exc:
            yield exc

