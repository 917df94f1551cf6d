"""torch's private API the toolkit reaches into: DCP's storage entry, FSDP2's parameter groups, c10d's collective
counter and NCCL flight recorder, the autograd engine's Python entry point (for Megatron-Core's CPU layer), the
dispatch mode that counts live tensor bytes (toolkit/estimate/measure.py), a module's forward replaced on the instance,
the private functions a torch.save archive or a DCP .metadata names (checkpoint/safe_load.py allows them), and the
memory recordings of a profiled step (toolkit/runtime/profile.py): the profiler's deprecated memory timeline on CPU,
the CUDA allocator's history on GPU."""

from __future__ import annotations

import types
import warnings

from toolkit.compat import Seam

# the private torch functions and tables pickles name that checkpoint/safe_load.py's allow-lists let through:
# torch.save's tensor and parameter rebuilders, and DCP metadata's memory-format table and layout lookup
PICKLED_TENSOR_REBUILDERS = ("torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
                             "torch._tensor._rebuild_from_type_v2")
PICKLED_DCP_METADATA = ("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", "torch.serialization._get_layout")
SEAMS = [
    *(Seam("torch", name, "named by the pickles torch.save writes (every tensor, every parameter); "
                          "checkpoint/safe_load.py allows the name, so a torch that drops it reads no checkpoint")
      for name in PICKLED_TENSOR_REBUILDERS),
    *(Seam("torch", name, "named by the pickle of DCP's .metadata (TensorProperties' memory format and layout); "
                          "checkpoint/safe_load.py allows the name") for name in PICKLED_DCP_METADATA),
    Seam("torch", "torch.nn.modules.module.Module._call_impl.forward", kind="in_source",
         why="a module call looks its forward up on the instance at every call: replace_forward's forward, set on the "
             "instance, is what runs (the class, shared by every model, is left alone), also under the engines' "
             "wrappers, which call the module"),
    Seam("torch", "torch.distributed.checkpoint.filesystem._StorageInfo",
         "the storage entry (file, offset, length) of each chunk in DCP's .metadata: Megatron's dist_writer.py writes "
         "one chunk at a time itself (torch's keeps a file's chunks in memory), and DCP's FileSystemReader and "
         "checkpoint/safe_load.py's allow-list and check_storage_paths (is_storage_entry) read back exactly this class; DCP has no public constructor for it"),
    Seam("torch", "torch.distributed.fsdp.FSDPModule._get_fsdp_state",
         "the offload policy fully_shard really applied (backends/fsdp.py checks it against the plan): FSDP2 has no "
         "public getter for a module's parameter groups"),
    Seam("torch", "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_groups", kind="in_source",
         why="the FSDP2 parameter groups of a module (each with its offload_policy); older torch had only the "
             "single-group property _fsdp_param_group"),
    Seam("torch", "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_group",
         "the single-group form of _fsdp_param_groups, read where the list is missing (older torch)"),
    Seam("torch", "torch.distributed.ProcessGroup._get_sequence_number_for_group",
         "the watchdog's count of collectives issued (one integer, no communication) that tells a hang inside a "
         "collective from one outside; c10d exposes no public counter"),
    Seam("torch", "torch._C._distributed_c10d._dump_nccl_trace", only_with="nccl",
         why="the NCCL flight recorder's dump that incident.json's last words keep, as NCCL's own timeout writes it; "
             "torch.distributed has no public dump (CPU builds have only the backend-neutral _dump_fr_trace)"),
    Seam("torch", "torch._C._distributed_c10d._dump_fr_trace",
         "the backend-neutral flight recorder's dump (gloo records into it in torch 2.13 with TORCH_FR_BUFFER_SIZE): "
         "what torch.distributed.flight_recorder's analyser reads; torch.distributed has no public dump"),
    Seam("torch", "torch.distributed.distributed_c10d._world",
         "every process group of this process with its name and description: gloo's dump names its groups '' in "
         "torch 2.13, so the pg_config the analyser matches collectives by is filled in from here"),
    Seam("torch", "torch.autograd.graph._engine_run_backward",
         "the one Python entry of every backward: Megatron-Core's CPU layer (megatron_cpu.py) wraps it so its torch "
         "function mode is on while recomputation runs forwards inside backward; no public hook runs there"),
    Seam("torch", "torch.autograd._engine_run_backward",
         "the same function as torch.autograd.graph._engine_run_backward, imported by torch.autograd under its own "
         "name (backward() calls it from there): both names are wrapped"),
    Seam("torch", "torch.utils._python_dispatch.TorchDispatchMode",
         "a mode that sees every aten op's outputs (toolkit/estimate/measure.py's peak of live tensor bytes on CPU, "
         "where no allocator keeps a peak); torch has no public dispatch-level mode"),
    Seam("torch", "torch.Tensor._is_view",
         "whether an op's output is a view (of a parameter, say), which allocates nothing; Tensor has no public "
         "predicate"),
    Seam("torch", "torch.utils._pytree.tree_leaves",
         "the tensors among a dispatched op's nested arguments, so that an output aliasing one of them (aten.t of a "
         "weight, which dispatch does not mark a view; an in-place op's result) is not counted as allocated; torch "
         "has no public flattening of an op's arguments"),
    Seam("torch", "torch.overrides._get_current_function_mode_stack",
         "whether a torch function mode is already on (the backward wrapper must not push it twice); torch.overrides "
         "has no public query of the active modes"),
    Seam("torch", "torch.profiler.profile.export_memory_timeline", parameters=("self", "path", "device"),
         why="the memory timeline of a CPU rank's profiled steps (training.profile.memory). Deprecated in torch 2.13 "
             "(a FutureWarning, silenced by memory_timeline); the replacement it names, the allocator's memory "
             "history, records the CUDA (and XPU) caching allocator only: torch 2.13 has no other CPU timeline"),
    Seam("torch", "torch.profiler.profile.mem_tl", kind="in_source",
         why="the timeline export_memory_timeline has just built (torch.profiler._memory_profiler."
             "MemoryProfileTimeline): its raw events are written from it, not from a second analysis of the "
             "recording (the analysis is most of the export's time)"),
    Seam("torch", "torch.profiler._memory_profiler.MemoryProfileTimeline.export_memory_timeline_raw",
         parameters=("self", "path", "device_str"),
         why="the timeline's raw events as JSON, which export_memory_timeline writes only gzipped through a second "
             "analysis of the recording"),
    Seam("torch", "torch.cuda.memory._record_memory_history",
         "the CUDA caching allocator's history of allocations and frees with their stacks over a GPU rank's profiled "
         "steps (training.profile.memory): what torch 2.13's deprecation of export_memory_timeline points to; "
         "torch.cuda.memory has no public switch for it"),
    Seam("torch", "torch.cuda.memory._dump_snapshot", parameters=("filename", "augment_with_fx_traces"),
         why="writes that history as the pickle pytorch.org/memory_viz opens (the deprecation note's "
             "_export_memory_snapshot does not exist in torch 2.13); no public writer"),
]
# the FutureWarning torch 2.13 attaches to export_memory_timeline (torch/profiler/profiler.py), matched from its start
MEMORY_TIMELINE_DEPRECATION = r"`export_memory_timeline` is deprecated"


def replace_forward(module, forward) -> None:
    """`forward(self, ...)` runs for this module instead of its class's forward (what its calls reach)."""
    module.forward = types.MethodType(forward, module)


def storage_entry(file_name: str, offset: int, length: int):
    """DCP's record of where one written item lies (what FileSystemWriter's own write_data returns)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(file_name, offset, length)


def is_storage_entry(value) -> bool:
    """Whether a value of DCP's .metadata storage_data is such a record (checkpoint/safe_load.py checks each)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return isinstance(value, _StorageInfo)


def fsdp_param_groups(module) -> list:
    """The FSDP2 parameter groups of a module that fully_shard wrapped (FSDPModule)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    return [group for group in groups if group is not None]


def collectives_issued(group) -> int:
    """The process group's sequence number: collectives (and point-to-point ops) issued through it so far."""
    return int(group._get_sequence_number_for_group())


def flight_recorder_dump() -> bytes:
    """torch's flight recorder dump of this process (every backend that records into it: gloo in torch 2.13), with
    its groups' names, descriptions and ranks where the dump left them out: what torch.distributed.flight_recorder's
    analyser reads (its pg_config, by group name; gloo writes one entry named '')."""
    import pickle

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    # not from elsewhere: the bytes are this process's own recorder, pickled by torch's C++ a line above (never read
    # from a file or a peer), so the unrestricted loader runs nothing another party wrote. torch's analyser
    # (runtime/incident.py) unpickles only the dumps this job's own ranks wrote into this attempt's incident directory
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    config = {name: entry for name, entry in (dump.get("pg_config") or {}).items() if name}
    for group, name in distributed_c10d._world.pg_names.items():
        if name not in config:
            config[name] = {"name": name, "desc": getattr(group, "group_desc", "undefined"),
                            "ranks": str(sorted(dist.get_process_group_ranks(group)))}
    dump["pg_config"] = config
    return pickle.dumps(dump)


def nccl_trace_dump() -> bytes:
    """torch's NCCL flight recorder dump (a pickle of the last collectives, their state and stacks); raises where the
    build has no NCCL."""
    import torch

    return torch._C._distributed_c10d._dump_nccl_trace(True, True, False)


def backward_entry_points() -> list[tuple[object, str]]:
    """(owner, name) of the autograd engine's Python entry, under each name backward() may reach it by."""
    import torch.autograd
    import torch.autograd.graph

    return [(torch.autograd.graph, "_engine_run_backward"), (torch.autograd, "_engine_run_backward")]


def function_mode_active(mode) -> bool:
    """Whether this torch function mode is on the current stack."""
    import torch.overrides

    return mode in torch.overrides._get_current_function_mode_stack()


def live_storage_mode():
    """A dispatch mode that adds up the storages the ops under it return, until each is freed: `.live`, `.peak` and
    `.at` (the op that reached the peak). Storages made before it (parameters) are not counted, nor views and other
    aliases of an op's inputs (a transposed weight, a reshaped activation, an in-place result), which allocate
    nothing."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveStorage(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.at = ""
            self.held: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                      if isinstance(a, torch.Tensor)}
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if not isinstance(tensor, torch.Tensor) or tensor._is_view():  # a view allocates nothing
                    continue
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size == 0 or key in self.held or key in inputs:  # nor does an alias of an input
                    continue
                self.held.add(key)
                self.live += size
                weakref.finalize(storage, self.freed, key, size)
                if self.live > self.peak:
                    self.peak, self.at = self.live, func.__name__
            return out

        def freed(self, key: int, size: int) -> None:
            self.held.discard(key)
            self.live -= size

    return LiveStorage()


def memory_timeline(profiler, plot_path, events_path, device: str) -> None:
    """torch.profiler's memory timeline of a recording made with profile_memory, record_shapes and with_stack: the
    plot of memory by category over time (HTML with the PNG inside; nothing is written without matplotlib) at
    `plot_path`, and its raw events at `events_path` (JSON: one [time ns, action, bytes, category] per event, the
    action torch.profiler._memory_profiler.Action's value, 2 a tensor created, 4 destroyed). The deprecation warning
    is torch's notice that the function will go, not a fault of this run: it is silenced here, where the seam is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=MEMORY_TIMELINE_DEPRECATION, category=FutureWarning)
        profiler.export_memory_timeline(str(plot_path), device=device)
    profiler.mem_tl.export_memory_timeline_raw(str(events_path), device)


def record_cuda_memory_history(max_entries: int | None) -> None:
    """Start recording the CUDA caching allocator's allocations and frees with their stacks, the last `max_entries`
    kept; None stops it and drops the history."""
    import torch

    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=max_entries)


def dump_cuda_memory_snapshot(path) -> None:
    """The recorded history and the allocator's state as the pickle pytorch.org/memory_viz opens."""
    import torch

    torch.cuda.memory._dump_snapshot(str(path))
