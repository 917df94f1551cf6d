"""Accelerate's seams: the one CPU compatibility step for its FSDP2 (without it an FSDP run on CPU ranks silently
trains unsharded), and the reset of its process-wide state before an in-process restart builds a Trainer again.

On CPU (gloo) processes Accelerate's PartialState says `DistributedType.MULTI_CPU`, and AcceleratorState turns an
FSDP plugin into `DistributedType.FSDP` only for GPU-like types (accelerate/state.py, AcceleratorState.__init__: the
branch over MULTI_GPU, MULTI_NPU, ...). The plugin is dropped, the HF Trainer sees no `fsdp_plugin`, and the model
is wrapped in DistributedDataParallel: training runs and nothing says it was never sharded. FSDP2 itself
(`fully_shard`) works on CPU with gloo, so the step below does, for MULTI_CPU, exactly what that branch does for a
GPU: distributed type FSDP, the plugin's mixed precision, the plugin on the state (and CPUOffloadPolicy without
pinned memory, which needs an accelerator). Everything after it (fully_shard,
MixedPrecisionPolicy, DCP checkpoints) is the libraries' own code.

Used only while the Trainer builds its Accelerator, and only when there is no GPU; a GPU run never imports it.
toolkit/backends/fsdp/train.py checks after preparation, on every device, that the model really is sharded.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

from toolkit.compat import Seam

log = logging.getLogger(__name__)
SEAMS = [
    Seam("accelerate", "accelerate.state.AcceleratorState.__init__",
         "patched while the Trainer builds its Accelerator on CPU ranks: the branch that turns an FSDP plugin into "
         "DistributedType.FSDP runs inside it, for GPU-like types only, and Accelerate has no public hook after it "
         "and before the Accelerator reads the type"),
    Seam("accelerate", "accelerate.state.AcceleratorState._reset_state",
         "training.restart: in_process builds the HF Trainer again in the same process: AcceleratorState and "
         "PartialState are singletons (one _shared_state per process) that a new Accelerator reuses as the first "
         "call left them (its FSDP plugin, rank, world), so the restarted Trainer's optimizer state was not loaded "
         "on a reused rank (every Adam moment fresh); Accelerate's own tests reset them this way, nothing public does",
         parameters=("reset_partial_state",)),
    Seam("accelerate", "accelerate.state.GradientState._reset_state",
         "the same for GradientState, the third singleton (its gradient accumulation plugin and dataloaders)"),
]


def reset_process_state() -> None:
    """Forget Accelerate's process-wide state (AcceleratorState, PartialState, GradientState), as a fresh process
    has none: before an in-process restart builds the Trainer again. Its process group is the caller's to make."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@contextlib.contextmanager
def fsdp_on_cpu_ranks():
    """While active, an AcceleratorState created with an FSDP plugin on CPU ranks takes Accelerate's FSDP path."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy

    original = AcceleratorState.__init__
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        plugin = signature.bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self.mixed_precision != "no":  # the property reads the state's own field on a MULTI_CPU state
                plugin.set_mixed_precision(self.mixed_precision)
            if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and plugin.cpu_offload.pin_memory:
                # Accelerate builds CPUOffloadPolicy() with pin_memory=True; pinning needs an accelerator
                # ("Cannot access accelerator device when none is available"): on CPU ranks the host memory is
                # where the parameters already are, so the policy is the same without pinning.
                plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
            self.fsdp_plugin = plugin
            PartialState().distributed_type = DistributedType.FSDP  # the state every PartialState() shares
            log.info("CPU ranks: Accelerate takes its FSDP path (fsdp_version %s) instead of plain DDP",
                     plugin.fsdp_version)

    AcceleratorState.__init__ = __init__
    try:
        yield
    finally:
        AcceleratorState.__init__ = original
