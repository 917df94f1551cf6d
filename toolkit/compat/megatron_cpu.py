"""The one CPU compatibility layer for Megatron-Core: lets its CUDA-assuming code run on CPU ranks over gloo.

Megatron-Core is written for GPUs. On a machine without one (CI, the demo) it trips over four things, and this
module answers each, in one place, only while `cuda_on_cpu()` is active and only when no GPU is present (every name
it patches or reaches into is in `SEAMS`; torch's private ones through toolkit.compat.torch_seams):

1. `torch.cuda.current_device()` / `synchronize()` / `set_device()` -- answered as device 0 / no-ops, and the
   streams MoE's alltoall dispatcher copies on (`Stream`, `current_stream`, `stream`) -- one in-order CPU stream;
2. tensors created with a literal `device="cuda"` (grad-norm and loss-scale scalars, DDP buffers) and `.cuda()`
   -- a torch function mode puts them on the CPU; MLA's YaRN rotary embedding, which enters
   `torch.device(torch.cuda.current_device())` unless told to initialise on the CPU, is told so;
3. dtype checks that spell CUDA type names (`param.type() == "torch.cuda.FloatTensor"` in the optimizers) -- the
   same mode answers CPU tensors with the CUDA name of their dtype;
4. the CUDA RNG tracker (`model_parallel_cuda_manual_seed`, dropout forks, recompute) -- on CPU the CPU generator
   *is* the device generator, so the tracker forks the CPU generator's state.

Nothing here changes numerics: every op still runs torch's own CPU kernel. A GPU run never imports this module.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

from toolkit.compat import Seam
from toolkit.compat.torch_seams import backward_entry_points, function_mode_active

log = logging.getLogger(__name__)
_RANDOM = "megatron.core.tensor_parallel.random"
_TRACKER = f"{_RANDOM}.CudaRNGStatesTracker"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
SEAMS = [
    *(Seam("torch", f"torch.cuda.{name}", f"patched while the layer is on: {why}") for name, why in (
        ("current_device", "Megatron-Core asks for the current CUDA device everywhere; device 0 on CPU"),
        ("synchronize", "a no-op without a GPU"),
        ("set_device", "a no-op without a GPU"),
        ("Stream", "MoE's alltoall token dispatcher makes a side stream for its device-to-host copies; on CPU one "
                   "stream that runs everything in order"),
        ("current_stream", "the dispatcher compares its side stream with the current one; the same CPU stream"),
        ("stream", "the dispatcher's `with torch.cuda.stream(...)`: a no-op context on CPU"),
        ("manual_seed", "Megatron's seeding seeds the CUDA generator; on CPU the CPU generator is the device's"),
        ("get_rng_state", "Megatron saves the CUDA generator's state; on CPU the CPU generator's"),
    )),
    Seam("megatron-core", f"{_RANDOM}._CUDA_RNG_STATE_TRACKER",
         "the module-global RNG tracker get_cuda_rng_tracker() returns, replaced by the CPU tracker while the layer is "
         "on: Megatron-Core has no public way to install another tracker class without Transformer Engine"),
    Seam("megatron-core", f"{_RANDOM}._CUDA_RNG_STATE_TRACKER_INITIALIZED",
         "set with the tracker above, so get_cuda_rng_tracker() does not build a CUDA one over it"),
    Seam("megatron-core", f"{_RANDOM}._get_cuda_rng_state",
         "the state save of activation recomputation (CheckpointFunction), pointed at the CPU generator"),
    Seam("megatron-core", f"{_RANDOM}._set_cuda_rng_state",
         "the state restore of activation recomputation, pointed at the CPU generator"),
    Seam("megatron-core", "megatron.core.transformer.multi_latent_attention.YarnRotaryEmbedding",
         "MLA builds it without use_cpu_initialization, so it enters torch.device(cuda:0), which a CPU-only torch "
         "refuses; while the layer is on, MLA builds it with use_cpu_initialization=True (the same frequencies)"),
    Seam("megatron-core", f"{_DISPATCHER}.maybe_move_tensor_to_cpu",
         "the alltoall dispatcher's device-to-host copy of its split sizes: on a GPU they arrive as numpy arrays, which "
         "all_to_all_single takes; on CPU the library's helper leaves them tensors, so the CPU tensors are handed over "
         "as the same numpy arrays"),
    Seam("megatron-core", f"{_TRACKER}._is_initialized", kind="in_source",
         why="the CPU tracker subclass keeps the base class's bookkeeping (is_initialized() reads it)"),
    Seam("megatron-core", f"{_TRACKER}._current_state_name", kind="in_source",
         why="the CPU tracker's fork() keeps the base class's record of the state in use (nested forks)"),
]

# what `Tensor.type()` answers on a GPU, for the dtypes Megatron-Core's optimizers check
CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def needed() -> bool:
    """True when this process has no GPU, so Megatron-Core needs the layer."""
    return not torch.cuda.is_available()


def _is_device(value) -> bool:
    """A device argument that means an accelerator (on a CPU-only build, an index can only mean cuda:N)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


class CudaTensorsOnCpu(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU for every torch call, and reports CPU tensors under their CUDA type name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return CUDA_TYPE_NAMES.get(name, name)
        if _is_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to, torch.Tensor.pin_memory) and len(args) > 1 and _is_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's RNG tracker with the CPU generator as the device generator: named states (data-parallel,
        tensor-parallel, expert) are CPU generator states, and `fork` swaps them in and out around the block."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            previous = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(previous)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            previous, previous_name = torch.get_rng_state(), self._current_state_name
            if previous_name != "default-rng":
                self.states_[previous_name] = previous
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(self.states_[previous_name] if previous_name != "default-rng" else previous)
                self._current_state_name = previous_name

    return CpuRNGStatesTracker


def _install_rng(patches: list) -> None:
    """Point Megatron-Core's RNG plumbing at the CPU generator (tracker, seeding, recompute's state save/restore)."""
    import megatron.core.tensor_parallel.random as mrandom

    tracker = _cpu_rng_tracker_class()()
    patches += [
        (mrandom, "_CUDA_RNG_STATE_TRACKER", tracker),
        (mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True),
        (mrandom, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (mrandom, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
        (torch.cuda, "manual_seed", torch.manual_seed),
        (torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
    ]


class CpuStream:
    """The one CPU "stream": work runs in program order, so waiting for it, or for its events, is already done."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return self  # an event of an in-order stream is complete when recorded: synchronize() is a no-op


_CPU_STREAM = CpuStream()


def _install_device(patches: list) -> None:
    patches += [
        (torch.cuda, "Stream", CpuStream),
        (torch.cuda, "current_stream", lambda *args, **kwargs: _CPU_STREAM),
        (torch.cuda, "stream", lambda *args, **kwargs: contextlib.nullcontext()),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        (torch.cuda, "set_device", lambda *args, **kwargs: None),
    ]


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """moe_utils.maybe_move_tensor_to_cpu as a GPU run sees it: a tensor (here already on the host), as numpy if asked."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().numpy()
    return tensor


def _install_moe(patches: list) -> None:
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    patches.append((dispatcher, "maybe_move_tensor_to_cpu", _host_copy))


def _install_mla(patches: list) -> None:
    import functools

    from megatron.core.transformer import multi_latent_attention as mla

    patches.append((mla, "YarnRotaryEmbedding", functools.partial(mla.YarnRotaryEmbedding,
                                                                   use_cpu_initialization=True)))


def _install_backward(patches: list, mode: TorchFunctionMode) -> None:
    """A torch-function mode is off while it handles a call, so the backward it hands on would run recomputation
    (activation checkpointing re-runs forwards, e.g. Megatron's causal mask built with device="cuda") without it:
    the autograd engine's entry point puts the mode back on."""
    entry_points = backward_entry_points()
    owner, name = entry_points[0]
    original = getattr(owner, name)

    def run_backward(*args, **kwargs):
        if function_mode_active(mode):
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)

    patches += [(owner, name, run_backward) for owner, name in entry_points]


@contextlib.contextmanager
def cuda_on_cpu():
    """While active (and only without a GPU), Megatron-Core runs on CPU tensors; everything is undone on exit."""
    if not needed():
        yield
        return
    patches: list = []
    mode = CudaTensorsOnCpu()
    _install_device(patches)
    _install_rng(patches)
    _install_moe(patches)
    _install_mla(patches)
    _install_backward(patches, mode)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    log.info("no GPU: Megatron-Core runs on CPU through toolkit.compat.megatron_cpu")
    try:
        with mode:
            yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
