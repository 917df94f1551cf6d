"""The allow-lists of pickled globals each checkpoint format may name, and the restricted unpickler that holds a pickle
to one (toolkit/checkpoint/safe_load.py says where each is used; torch_zip.py indexes torch.save archives with it).

The allow-lists are what the real libraries write (found with torch's get_unsafe_globals_in_checkpoint and the
globals of checkpoints saved by DeepSpeed 0.19, Megatron-Core 0.16 (its converter's and its training's) and torch
2.13's DCP, FSDP2 through Accelerate).
"""

from __future__ import annotations

import pickle
from pathlib import Path

from toolkit.compat.stdlib_seams import python3_name
from toolkit.compat.torch_seams import PICKLED_DCP_METADATA, PICKLED_TENSOR_REBUILDERS
from toolkit.errors import UserInputError
from toolkit.readers import problem

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
# NVRx's local checkpoint of a Megatron-Core run (checkpoint.local): its LocalCheckpointManager torch.saves Megatron-Core's
# MCoreTensorAwareStateDict, dataclasses of the sharded state around the stored objects' contents
NVRX_LOCAL = STORED_OBJECT | {
    "megatron.core.dist_checkpointing.tensor_aware_state_dict.MCoreTensorAwareStateDict",
    "megatron.core.dist_checkpointing.mapping.ShardedTensor", "megatron.core.dist_checkpointing.mapping.ShardedObject",
}
FORMATS = {DCP_METADATA: "torch.distributed.checkpoint metadata", DEEPSPEED: "a DeepSpeed checkpoint",
           STORED_OBJECT: "a Megatron-Core or DCP stored object", TENSORS: "a tensor file",
           HF_TRAINER: "an HF Trainer checkpoint's state file", NVRX_LOCAL: "an NVRx local checkpoint"}
# where each torch.save file a library's loader opens lies in a checkpoint, and its allow-list
TORCH_FILES = {"*_optim_states.pt": DEEPSPEED, "*_model_states.pt": DEEPSPEED, "common.pt": STORED_OBJECT,
               "rng_state*.pth": HF_TRAINER, "scheduler.pt": HF_TRAINER, "optimizer.pt": HF_TRAINER,
               "optimizer.bin": HF_TRAINER, "scaler.pt": HF_TRAINER, "pytorch_model*.bin": HF_TRAINER,
               "iter_*_*_local*.pt": NVRX_LOCAL}


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
