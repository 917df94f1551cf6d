"""Megatron-Core's own pipeline schedules run rank by rank in one process, recording what each rank computes and
which point-to-point transfers it posts and waits for, instead of sending them.

The step model's pipeline terms (toolkit/estimate/timing.py: the bubble, the exchanges a rank waits for) are checked
against this record (tests/unit/test_pipeline_schedule.py replays it with stage and transfer times): the call order is
schedules.py's, not a copy of it, for 1F1B and for the interleaved schedule with and without `overlap_p2p_comm`.
The only thing replaced is the transport: `P2PCommunicator._communicate`, which every send/receive helper of
p2p_communication.py funnels through, records the transfers and hands back empty tensors (and, where the schedule
asks for them, wait handles whose `wait()` is recorded too).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass

from toolkit.compat import Seam

SEAMS = [
    Seam("megatron-core", "megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator._communicate",
         "the one transport method of the schedules' send/receive helpers: overridden to record the transfers a rank "
         "posts and waits for, so that the schedule's own order can be replayed with transfer times; no public hook "
         "observes a schedule's point-to-point calls",
         parameters=("self", "tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next", "tensor_shape",
                     "wait_on_reqs")),
]

# (source rank, destination rank, "act" | "grad", n-th such tensor between the two): both ends name it alike
Transfer = tuple[int, int, str, int]


@dataclass(frozen=True)
class Compute:
    kind: str  # "F" | "B"
    chunk: int  # the rank's model chunk (virtual stage index on this rank)


@dataclass(frozen=True)
class Post:
    transfers: tuple[Transfer, ...]  # started, not waited for


@dataclass(frozen=True)
class Wait:
    transfers: tuple[Transfer, ...]  # the rank blocks until these are done


class _Group:
    """The pipeline group as the schedules ask it: its size and this rank's place in it."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Handle:
    def __init__(self, events: list, transfer: Transfer):
        self.events, self.transfer = events, transfer

    def wait(self) -> None:
        self.events.append(Wait((self.transfer,)))


def _recording_communicator(rank: int, pp: int, config, events: list):
    import torch
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    sent = Counter()  # (src, dst, kind) -> tensors so far, counted at this rank's own end

    def transfer(src: int, dst: int, kind: str) -> Transfer:
        n = sent[(src, dst, kind)]
        sent[(src, dst, kind)] += 1
        return src, dst, kind, n

    class RecordingCommunicator(P2PCommunicator):
        def __init__(self):  # no process group to ask for global ranks: the ring is 0..pp-1
            self.pp_group, self.config = _Group(rank, pp), config
            self.next_rank, self.prev_rank = (rank + 1) % pp, (rank - 1) % pp
            self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size

        def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                         wait_on_reqs=True):
            handles = {}
            if tensor_send_next is not None:
                handles["send_next"] = transfer(rank, self.next_rank, "act")
            if tensor_send_prev is not None:
                handles["send_prev"] = transfer(rank, self.prev_rank, "grad")
            if recv_prev:
                handles["recv_prev"] = transfer(self.prev_rank, rank, "act")
            if recv_next:
                handles["recv_next"] = transfer(self.next_rank, rank, "grad")
            if handles:
                events.append(Post(tuple(handles.values())))
            received = [torch.zeros(tensor_shape, requires_grad=True) if wanted else None
                        for wanted in (recv_prev, recv_next)]
            if wait_on_reqs:
                if handles:
                    events.append(Wait(tuple(handles.values())))
                return *received, None
            return *received, {key: _Handle(events, t) for key, t in handles.items()}

    return RecordingCommunicator()


def _chunk_module(config, chunk: int, events: list):
    import torch
    from megatron.core.enums import ModelType

    class RecordBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            events.append(Compute("B", chunk))
            return grad

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.model_type, self.input = config, ModelType.encoder_or_decoder, None
            self.weight = torch.nn.Parameter(torch.ones(1))

        def set_input_tensor(self, tensor):
            self.input = tensor[0] if isinstance(tensor, list) else tensor

        def forward(self, x):
            events.append(Compute("F", chunk))
            return RecordBackward.apply((x if self.input is None else self.input) * self.weight)

    return Chunk()


@contextlib.contextmanager
def _single_process_group():
    """The schedules read a group's rank only while torch.distributed is initialized: a 1-rank gloo group, in
    memory, for as long as the trace runs (left alone if the caller already has one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]": put back what the caller had
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def trace_schedule(pp: int, vpp: int, micro_batches: int, overlap_p2p_comm: bool = False) -> list[list]:
    """Each pipeline rank's events (Compute, Post, Wait) in the order Megatron-Core's get_forward_backward_func()
    issues them for one training step of `micro_batches` micro-batches."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from toolkit.compat.megatron_cpu import cuda_on_cpu  # lazy: megatron, as this function's own imports

    virtual = vpp if vpp > 1 else None
    config = TransformerConfig(num_layers=pp * vpp, hidden_size=4, num_attention_heads=1,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=virtual,
                               pipeline_dtype=torch.float32, overlap_p2p_comm=overlap_p2p_comm,
                               batch_p2p_comm=not overlap_p2p_comm)
    schedule = get_forward_backward_func(pp_size=pp, vp_size=virtual)
    traces = []
    with _single_process_group(), cuda_on_cpu():
        for rank in range(pp):
            events: list = []
            groups = ProcessGroupCollection()
            groups.tp = groups.cp = groups.dp_cp = _Group(0, 1)
            groups.pp, groups.embd, groups.pos_embd = _Group(rank, pp), None, None
            chunks = [_chunk_module(config, chunk, events) for chunk in range(vpp)]
            data = [torch.ones(2, 1, 4) for _ in range(micro_batches)]

            def forward_step(data_iterator, model):
                output = model(next(data_iterator))
                return output, lambda o: (o.sum(), {"loss": o.detach().sum()})

            schedule(forward_step_func=forward_step, data_iterator=[iter(data) for _ in chunks],
                     model=chunks, num_microbatches=micro_batches, seq_length=2, micro_batch_size=1,
                     p2p_communicator=_recording_communicator(rank, pp, config, events), pg_collection=groups)
            traces.append(events)
    return traces
