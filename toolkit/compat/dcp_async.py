"""torch.distributed.checkpoint's asynchronous save under Accelerate's FSDP2 save, as the HF Trainer calls it.

The Trainer saves an FSDP2 checkpoint through Accelerate's `save_fsdp_model` and `save_fsdp_optimizer`, each of which
builds its state dict (its own options, its own keys) and calls `dist_cp.save(state_dict=..., storage_writer=
FileSystemWriter(dir), planner=DefaultSavePlanner())`. Neither has a hook for the asynchronous save, so while they run
`torch.distributed.checkpoint.save` answers with `async_save` on the same state dict, writer and planner: the
checkpoint keeps Accelerate's layout (`pytorch_model_fsdp_0/`, `optimizer_0/`, read back by its loader unchanged).

Staging: each save gets its own `DefaultStager(StagingOptions(use_async_staging=True))`: the CPU copy of the state
dict (on CPU ranks too: `StateDictStager` copies every storage) is made by the stager's thread while training goes on
with the next step's forward and backward, and the write (planned and written in a thread of this rank) starts from
that copy. Training must not change the tensors before they are copied: `staged` holds each save's staging future,
which the caller waits for before the next optimizer step (and counts that wait as a pause). The stager is closed once
its write is done, so that its copy (the stager caches it for a next save otherwise) is freed: one copy per save, for
as long as it is written. No pinned or shared memory: pinning is for device copies, sharing for the PROCESS mode.

Mode: `AsyncCheckpointerType.THREAD` (the default). The PROCESS mode spawns a daemon process
per rank that opens a gloo group of its own (a TCPStore on a port rank 0 picks) and receives the staged copy through
a pipe; a SIGKILLed rank leaves that daemon behind, finishing files of a checkpoint a restart may be writing again
(what the toolkit had to end by hand for Megatron-Core's writer), and on CPU ranks it buys nothing a thread does not:
the write releases the GIL in its file I/O, and the copy is made by the staging thread in either mode. A thread dies
with its rank.

Each DCP directory of a checkpoint plans over a gloo group of its own (`groups`, made once by every rank): the
threads of one checkpoint run at the same time, and a group's collectives must never interleave with another
thread's, nor with training's on the default group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from toolkit.compat import Seam

SEAMS = [
    Seam("torch", "torch.distributed.checkpoint.save",
         "answered by async_save while the HF Trainer saves an FSDP2 checkpoint through Accelerate (no hook there for "
         "the asynchronous save); the background thread calls state_dict_saver.save, not this name"),
    *(Seam("accelerate", f"accelerate.utils.fsdp_utils.{name}.save", kind="in_source",
           why="Accelerate's FSDP save calls dist_cp.save by attribute (what the replacement above relies on)")
      for name in ("save_fsdp_model", "save_fsdp_optimizer")),
    Seam("torch", "torch.distributed.checkpoint.filesystem.FileSystemWriter.write_data",
         "wrapped on the writer Accelerate made: the caller's code (the test faults of the persist phase) runs in the "
         "background thread before the first byte is written"),
]


class GroupPool:
    """Gloo process groups for background writes, the i-th DCP save of a checkpoint on the i-th group; made on first
    use, at the same point of every rank's save (new_group is a collective of the default group)."""

    def __init__(self):
        self.groups: list = []

    def get(self, index: int):
        import torch.distributed as dist

        while len(self.groups) <= index:
            self.groups.append(dist.new_group(backend="gloo"))
        return self.groups[index]


@contextlib.contextmanager
def dcp_saves_in_background(groups: GroupPool, started: list, staged: list, before_write: Callable[[], None]):
    """While active, each `torch.distributed.checkpoint.save(...)` is held; when the context ends (every state dict
    built: nothing has changed the tensors since), each becomes an `async_save` on its own group of `groups`, staged
    by a thread of its own (its staging future appended to `staged`: the tensors may change once it is done) and
    written by another (its future appended to `started`), and `before_write()` runs in its writing thread before the
    first byte. Held until then, no copy or write competes with the building of the next state dict (the optimizer's:
    Python work, under the GIL)."""
    import torch.distributed.checkpoint as dcp

    original, held = dcp.save, []

    def save(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None, no_dist=False,
             use_collectives=True):
        if process_group is not None or no_dist or not use_collectives or storage_writer is None:
            raise RuntimeError("the asynchronous FSDP2 save expects Accelerate's dist_cp.save(state_dict, "
                               "storage_writer, planner); it was called otherwise")
        held.append((state_dict, checkpoint_id, storage_writer, planner))

    dcp.save = save
    try:
        yield
    finally:
        dcp.save = original
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    for state_dict, checkpoint_id, storage_writer, planner in held:
        storage_writer.write_data = functools.partial(_after, before_write, storage_writer.write_data)
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=False))
        response = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                  planner=planner, process_group=groups.get(len(started)), async_stager=stager)
        response.upload_completion.add_done_callback(lambda _, stager=stager: stager.close())  # its copy freed
        staged.append(response.staging_completion)
        started.append(response.upload_completion)


def _after(first: Callable[[], None], write, *args, **kwargs):
    first()
    return write(*args, **kwargs)
