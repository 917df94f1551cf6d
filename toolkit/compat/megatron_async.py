"""Megatron-Core's asynchronous checkpoint writer as the toolkit runs it: dist_checkpointing's persistent worker
(`AsyncCallsQueue(persistent=True)`), started by the toolkit instead of at the first save, so that it can

- start before the first save (spawning it and importing torch there would otherwise fall inside that save's pause);
- run on CPU ranks: 0.16.1's worker loop sets its CUDA device by `rank % torch.cuda.device_count()`, a division by
  zero without a GPU, and its staging copy (`preload_fn`) only copies device tensors: a CPU tensor would be written
  by the worker from the live training state while the optimizer changes it. On CPU the request's tensors are
  copied here instead, once, straight into shared memory
  (what Megatron's own `_clone_if_needed` leaves as a TODO for the persistent worker): the request's pickling into
  the worker's queue then passes a handle, not a second copy, and the copies replace the writer's tensors in its own
  write buckets, so that the clones `prepare_write_data` made of views are freed as they are copied. The copy runs in
  a thread of the rank (toolkit.backends.megatron.saves) while the next step's forward and backward run, which change
  nothing a save holds; training waits for what is left of it before the optimizer's update. Once the worker
  has the request (Megatron's preload handshake: `schedule_async_call` returns after the worker ran the request's
  `preload_fn`) the rank lets go of its references (`released`): the shared memory is the worker's alone and is freed
  when its write ends, not at the finalization of the next step. A save costs one copy of the state it writes;
- die with its rank: a rank killed mid-write must not leave a writer finishing the files of a checkpoint that a
  restart is writing again. The worker leads a process group of its own (its writer processes inherit it) and ends
  that group when its rank's process is gone;
- report, without a collective, whether this rank's write is done (a counter the worker advances after each write),
  for the bounded wait of an exit; and run the caller's wrapper around each write (the test faults of its phase).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading

from toolkit.compat import Seam

log = logging.getLogger(__name__)
_ASYNC = "megatron.core.dist_checkpointing.strategies.async_utils"
SEAMS = [
    Seam("megatron-core", f"{_ASYNC}.PersistentAsyncCaller.async_loop",
         "the persistent worker's own loop, run inside the toolkit's worker process (CPU-safe device calls, its "
         "group ended with its rank)"),
    *(Seam("megatron-core", f"{_ASYNC}.PersistentAsyncCaller.{name}", kind="in_source",
           why="the worker process the caller would start at the first save, started by the toolkit before it "
               "with the caller's own queues") for name in ("process", "queue", "preload_q", "comp_q")),
    Seam("megatron-core", f"{_ASYNC}.AsyncCallsQueue.persistent_caller", kind="in_source",
         why="the queue's persistent caller, given the worker started above"),
    Seam("megatron-core", "megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue",
         "the writers' results queue, which _get_write_results_queue makes on a multiprocessing manager (a process "
         "of its own) at the first save: made at start instead, on a manager that ends with its rank (Megatron's "
         "outlives a killed rank for ever)"),
    Seam("torch", "torch.cuda.device_count", "answered 1 inside the CPU worker process (the loop divides by it)"),
    Seam("megatron-core", "megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync."
                          "get_save_function_and_args", kind="in_source",
         why="the layout of the request's arguments, [rank, write_buckets, results_queue] with write buckets of "
             "(path, name, (bytes items, tensor items)), the writer's own list (its preload_fn's too): the CPU copy "
             "replaces the tensors in place, and the rank empties the tensor items once the worker has them "
             "(retrieve_write_results counts only the buckets)"),
    Seam("megatron-core", f"{_ASYNC}.PersistentAsyncCaller.schedule_async_call", kind="in_source",
         why="returns only once the worker ran the request's preload_fn (preload_q.join): the request is unpickled "
             "there, so the rank may release its tensors"),
    Seam("torch", "torch.UntypedStorage._new_shared",
         "a storage made in shared memory (the sharing strategy's), so that the CPU copy is made there once instead "
         "of in private memory and moved by the queue's pickling (Tensor.share_memory_ copies)"),
]
_written = None  # in the worker process: its count of finished writes (a shared integer the rank reads)


def start_writer(calls, ready_s: float) -> object:
    """Start the persistent worker of `calls` (an AsyncCallsQueue(persistent=True)) now and wait (at most `ready_s`)
    until it has imported what it writes with, so that no save waits for that; returns the shared count of its
    finished writes."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    from torch import multiprocessing as mp

    _results_queue(filesystem_async)
    caller = PersistentAsyncCaller()
    context = mp.get_context("spawn")
    written, ready = context.Value("q", 0), context.Event()
    caller.process = context.Process(target=_worker, args=(
        dist.get_rank(), caller.queue, caller.preload_q, caller.comp_q, logging.getLogger(_ASYNC).getEffectiveLevel(),
        written, ready, os.getpid(), torch.cuda.is_available()), name=f"dmt-checkpoint-writer-{dist.get_rank()}")
    caller.process.start()
    calls.persistent_caller = caller
    if not ready.wait(ready_s):
        log.warning("the checkpoint writer process did not start within %.0f s; the first save may wait for it",
                    ready_s)
    return written


_manager = None  # the results queue's manager: kept for the rank's lifetime (collected, it would shut down)


def start_results_queue() -> None:
    """Make the writers' results queue now, before the first save, for synchronous saves too: torch_dist's writer
    puts its results there whether or not the save runs in the background, and Megatron-Core would spawn the
    queue's manager process (importing this rank's main module again) inside the first save's pause."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _results_queue(filesystem_async)


def _results_queue(filesystem_async) -> None:
    """filesystem_async's results queue, as its _get_write_results_queue makes it (a queue on a spawned
    multiprocessing manager), on a manager process that watches this rank and ends when it is gone."""
    global _manager
    from multiprocessing.managers import SyncManager

    from torch import multiprocessing as mp

    if filesystem_async._results_queue is None:
        _manager = SyncManager(ctx=mp.get_context("spawn"))
        _manager.start(initializer=_ends_with, initargs=(os.getpid(),))
        filesystem_async._results_queue = _manager.Queue()


def _ends_with(parent: int) -> None:
    """In the manager process: end it once `parent` (its rank) is gone."""
    def watch():
        import time

        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="dmt-manager-parent").start()


def _worker(rank: int, queue, preload_q, comp_q, level: int, written, ready, parent: int, on_gpu: bool) -> None:
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: F401  (what requests unpickle)
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    global _written
    _written = written
    os.setpgid(0, 0)
    threading.Thread(target=_end_with, args=(parent,), daemon=True, name="dmt-writer-parent").start()
    if not on_gpu:  # this process is the worker's alone: nothing to undo
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda *args, **kwargs: None
        torch.cuda.synchronize = lambda *args, **kwargs: None
    ready.set()
    PersistentAsyncCaller.async_loop(rank, queue, preload_q, comp_q, level)


def _end_with(parent: int) -> None:
    """End this worker's process group (itself and the writer processes it forked) once `parent` is gone."""
    import time

    while os.getppid() == parent:
        time.sleep(0.1)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _counted(write, *args, **kwargs) -> None:
    """The write of one request, in the worker, counted when it ends (written or failed)."""
    try:
        write(*args, **kwargs)
    finally:
        with _written.get_lock():
            _written.value += 1


def prepared(request, around):
    """The AsyncRequest to schedule: its write called as `around(write, *args)` in the worker and counted."""
    if request.async_fn is None:  # nothing for this rank to write
        return request
    return request._replace(async_fn=functools.partial(_counted, functools.partial(around, request.async_fn)))


def needs_copy(request) -> bool:
    """Whether this rank must copy the request's tensors itself before the worker gets them (CPU ranks: the worker's
    preload_fn only copies device tensors)."""
    import torch

    return request.async_fn is not None and not torch.cuda.is_available()


def copied(request):
    """On CPU, the request's tensors copied into shared memory (in place in its write buckets), so that the worker
    writes the state as it was when the save was taken whatever training does after the copy. Safe to run in a
    thread while training computes, as long as nothing the save holds changes meanwhile (the optimizer's update)."""
    for _path, _name, (_items, tensors) in request.async_fn_args[1]:
        for index, (item, tensor) in enumerate(tensors):  # one at a time: a view's clone goes as its copy comes
            tensors[index] = (item, _shared_copy(tensor))
    return request


def _shared_copy(tensor):
    import torch

    storage = torch.UntypedStorage._new_shared(tensor.numel() * tensor.element_size())
    return torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape).copy_(tensor.detach())


def released(request) -> None:
    """After `schedule_async_request(request)` returned (the worker holds its own handles of the tensors): the rank's
    references to the copies dropped, so that the worker's write frees them. The bucket list keeps its length, which
    the finalization checks the write results against."""
    if not needs_copy(request):  # on a GPU the worker made the host copy itself
        return
    for _path, _name, (_items, tensors) in request.async_fn_args[1]:
        tensors.clear()


def stop_writer(calls) -> None:
    """Kill the worker of `calls` and its writer processes (a write in progress is abandoned: its checkpoint has no
    manifest)."""
    caller = calls.persistent_caller
    if caller is not None and caller.process is not None and caller.process.pid:
        try:
            os.killpg(caller.process.pid, signal.SIGKILL)  # its group: itself and its writers
        except ProcessLookupError:  # not yet its own group's leader
            pass
        caller.process.kill()
        caller.process = None
