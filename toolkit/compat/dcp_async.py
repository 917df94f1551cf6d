"""torch.distributed.checkpoint's asynchronous save under Accelerate's FSDP2 save, as the HF Trainer calls it.

The Trainer saves an FSDP2 checkpoint through Accelerate's `save_fsdp_model` and `save_fsdp_optimizer`, each of which
builds its state dict (its own options, its own keys) and calls `dist_cp.save(state_dict=..., storage_writer=
FileSystemWriter(dir), planner=DefaultSavePlanner())`. Neither has a hook for the asynchronous save, so while they run
`torch.distributed.checkpoint.save` answers with `async_save` on the same state dict, writer and planner: the
checkpoint keeps Accelerate's layout (`pytorch_model_fsdp_0/`, `optimizer_0/`, read back by its loader unchanged).

Mode: `AsyncCheckpointerType.THREAD` (the default). `async_save` first stages the state dict into a CPU copy while
training waits (the writer's own `BlockingAsyncStager`; on CPU ranks too: checked, the write holds the values of the
step it was saved at), then plans and writes it in a thread of this rank. The PROCESS mode spawns a daemon process
per rank that opens a gloo group of its own (a TCPStore on a port rank 0 picks) and receives the staged copy through
a pipe; a SIGKILLed rank leaves that daemon behind, finishing files of a checkpoint a restart may be writing again
(what the toolkit had to end by hand for Megatron-Core's writer), and on CPU ranks it buys nothing a thread does not:
the write releases the GIL in its file I/O, and the copy is made before either mode returns. A thread dies with its
rank.

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
def dcp_saves_in_background(groups: GroupPool, started: list, before_write: Callable[[], None]):
    """While active, each `torch.distributed.checkpoint.save(...)` is held; when the context ends (every state dict
    built: nothing has changed the tensors since), each becomes an `async_save` on its own group of `groups`, its
    future appended to `started`, and `before_write()` runs in its writing thread before the first byte. Held until
    then, no write competes with the building of the next state dict (the optimizer's: Python work, under the GIL)."""
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
    for state_dict, checkpoint_id, storage_writer, planner in held:
        storage_writer.write_data = functools.partial(_after, before_write, storage_writer.write_data)
        started.append(dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                      planner=planner, process_group=groups.get(len(started))))


def _after(first: Callable[[], None], write, *args, **kwargs):
    first()
    return write(*args, **kwargs)
