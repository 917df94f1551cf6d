"""The pipeline terms of the step model (bubble, point-to-point exchanges, the data-parallel reduction's overlap)
against event-driven runs of Megatron-Core's schedules (megatron/core/pipeline_parallel/schedules.py): its 1F1B order
written out, and both schedules' own calls as toolkit.compat.megatron_schedule_trace records them, with stages of
unequal work: the last one carries the head and the loss, the first the embedding."""

from __future__ import annotations

import pytest

from toolkit.compat.megatron_schedule_trace import Compute, Post, trace_schedule
from toolkit.estimate.timing import DP_OVERLAP, exposed_after_cooldown, pipeline_bubble_s, pipeline_exchanges
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan


def one_f_one_b(stage: int, pp: int, m: int) -> list[tuple[str, object]]:
    """Rank `stage`'s calls in schedules.py's order: ("F"|"B", micro-batch) and ("p2p", [(send|recv, tag)]) for each
    blocking (batched) exchange; a call whose peer does not exist (before the first stage, after the last) is empty."""
    first, last = stage == 0, stage == pp - 1

    def recv_forward(j):
        return [] if first else [("recv", ("act", stage - 1, j))]

    def send_forward(j):
        return [] if last else [("send", ("act", stage, j))]

    def recv_backward(j):
        return [] if last else [("recv", ("grad", stage, j))]

    def send_backward(j):
        return [] if first else [("send", ("grad", stage - 1, j))]

    warmup = min(pp - stage - 1, m)
    calls = []
    for j in range(warmup):
        calls += [("p2p", recv_forward(j)), ("F", j), ("p2p", send_forward(j))]
    if m > warmup:
        calls.append(("p2p", recv_forward(warmup)))
    for i in range(m - warmup):
        calls += [("F", i + warmup), ("p2p", send_forward(i + warmup) + recv_backward(i)), ("B", i)]
        calls.append(("p2p", send_backward(i) + (recv_forward(i + warmup + 1) if i < m - warmup - 1 else [])))
    for j in range(m - warmup, m):
        calls += [("p2p", recv_backward(j)), ("B", j), ("p2p", send_backward(j))]
    return calls


def run_schedule(pp: int, m: int, forward_s: list[float], backward_s: list[float], transfer_s: float) -> float:
    """Seconds until the last rank finishes: a transfer starts when both ends have called it and takes transfer_s; a
    batched call returns when all of its transfers are done."""
    calls = [one_f_one_b(stage, pp, m) for stage in range(pp)]
    at, clock, called = [0] * pp, [0.0] * pp, {}
    moved = True
    while moved:
        moved = False
        for stage in range(pp):
            while at[stage] < len(calls[stage]):
                kind, what = calls[stage][at[stage]]
                if kind != "p2p":
                    clock[stage] += (forward_s if kind == "F" else backward_s)[stage]
                else:
                    for side, tag in what:
                        called.setdefault((side, tag), clock[stage])
                    peers = [("recv" if side == "send" else "send", tag) for side, tag in what]
                    if not all(peer in called for peer in peers):
                        break
                    ends = [max(called[(side, tag)], called[peer]) + transfer_s
                            for (side, tag), peer in zip(what, peers)]
                    clock[stage] = max([clock[stage], *ends])
                at[stage] += 1
                moved = True
    assert at == [len(c) for c in calls], "the schedule deadlocked"
    return max(clock)


@pytest.mark.parametrize("pp, m, head, embedding, transfer_s", [
    (4, 16, 0.3, 0.0, 0.05),  # a heavy loss stage, few micro-batches
    (8, 8, 0.5, 0.0, 0.05),  # m = pp: the old (m + p - 1) x slowest was 19% over
    (16, 64, 0.06, 0.01, 0.03),  # the shape of the deep Megatron-LM rows: a few layers a stage, a 6% heavier last one
    (8, 32, 0.2, 0.1, 0.02),  # both ends heavier
    (4, 16, 0.0, 0.0, 0.1),  # equal stages
])
def test_step_model_pipeline_terms_follow_the_1f1b_order(pp, m, head, embedding, transfer_s):
    plan = resolve_plan(load_model_spec("llama-3.2-1b"), pp, backend="megatron", pp=pp, seq_len=2048, global_batch=m)
    assert plan.grad_accum == m and plan.vpp == 1
    work = [3.0] * pp  # forward 1, backward 2 per micro-batch
    work[-1] += 3 * head
    work[0] += 3 * embedding
    simulated = run_schedule(pp, m, [w / 3 for w in work], [2 * w / 3 for w in work], transfer_s)
    micro = {stage: work[stage] + pipeline_exchanges(plan, stage) * transfer_s for stage in (0, 1, pp - 1)}
    modelled = m * max(micro.values()) + pipeline_bubble_s(plan, micro)
    assert modelled == pytest.approx(simulated, rel=0.015)
    assert pipeline_exchanges(plan, 0) == pipeline_exchanges(plan, pp - 1) == 1 and pipeline_exchanges(plan, 1) == 2


def replay(traces: list[list], work: list[list[float]], transfer_s: float) -> float:
    """Seconds until the last rank finishes Megatron-Core's own schedule (toolkit.compat.megatron_schedule_trace):
    chunk c of rank r computes work[r][c] a micro-batch (1/3 forward, 2/3 backward); a transfer starts once both ends
    have posted it and takes transfer_s for each tensor its call sends (or receives) alongside it: the rank's link is
    shared, so an interleaved call that sends an activation on and a gradient back pays for both."""
    pp = len(traces)
    at, clock, posted = [0] * pp, [0.0] * pp, {}
    moved = True
    while moved:
        moved = False
        for rank in range(pp):
            while at[rank] < len(traces[rank]):
                event = traces[rank][at[rank]]
                if isinstance(event, Compute):
                    clock[rank] += work[rank][event.chunk] * (1 / 3 if event.kind == "F" else 2 / 3)
                elif isinstance(event, Post):
                    sends = sum(t[0] == rank for t in event.transfers)
                    for t in event.transfers:
                        side = "send" if t[0] == rank else "recv"
                        posted[side, t] = clock[rank], sends if side == "send" else len(event.transfers) - sends
                else:
                    if not all(("send", t) in posted and ("recv", t) in posted for t in event.transfers):
                        break
                    clock[rank] = max([clock[rank], *(max(posted["send", t][0], posted["recv", t][0]) + transfer_s
                                                      * max(posted["send", t][1], posted["recv", t][1])
                                                      for t in event.transfers)])
                at[rank] += 1
                moved = True
    assert at == [len(t) for t in traces], "the schedule deadlocked"
    return max(clock)


@pytest.mark.parametrize("pp, vpp, m, head, transfer_s", [
    (4, 2, 16, 0.3, 0.0),  # a heavy loss chunk: the bubble is the other ranks' (p-1)/v
    (4, 2, 16, 0.0, 0.05),  # equal chunks, transfers on the critical path
    (8, 4, 32, 0.1, 0.02),
    (16, 3, 48, 0.06, 0.01),  # the deep Megatron-LM rows' shape: a layer a chunk, a 6% heavier last rank
])
def test_interleaved_terms_follow_megatron_cores_own_schedule(pp, vpp, m, head, transfer_s):
    """The bubble (p-1)/v and the 2v exchanges a rank waits for per micro-batch, against Megatron-Core's interleaved
    schedule as the generated configs run it (overlap_p2p_comm off: one batched call after each forward-backward
    pair of chunks, sending an activation on and a gradient back)."""
    model = load_model_spec("llama-3.2-1b").model_copy(update={"num_layers": pp * vpp})  # a layer a chunk
    plan = resolve_plan(model, pp, backend="megatron", pp=pp, vpp=vpp, seq_len=2048, global_batch=m)
    assert plan.grad_accum == m and plan.vpp == vpp
    work = [[3.0 / vpp] * vpp for _ in range(pp)]
    work[-1][-1] += 3 * head
    simulated = replay(trace_schedule(pp, vpp, m), work, transfer_s)
    micro = {stage: sum(work[stage]) + pipeline_exchanges(plan, stage) * transfer_s for stage in (0, 1, pp - 1)}
    assert m * max(micro.values()) + pipeline_bubble_s(plan, micro) == pytest.approx(simulated, rel=0.015)


def test_megatron_cores_1f1b_order_is_the_one_modelled():
    """The hand-written 1F1B order above is Megatron-Core's: both replay to the same step."""
    pp, m, transfer_s = 8, 32, 0.02
    work = [3.0] * pp
    work[-1] += 0.6
    traced = replay(trace_schedule(pp, 1, m), [[w] for w in work], transfer_s)
    assert traced == pytest.approx(run_schedule(pp, m, [w / 3 for w in work], [2 * w / 3 for w in work], transfer_s))


def test_first_rank_reduces_all_but_its_first_chunk_under_the_cooldown():
    """Under interleaving the first rank finishes last, and c x pp chunk backwards follow chunk c's last one in
    schedules.py's order: exposed_after_cooldown's window. With reductions shorter than that window only the first
    chunk's is left after the last backward; longer ones queue on the link."""
    pp, vpp, m = 8, 4, 32
    backwards = [e.chunk for e in trace_schedule(pp, vpp, m)[0] if isinstance(e, Compute) and e.kind == "B"]
    after_last = {c: len(backwards) - 1 - max(i for i, chunk in enumerate(backwards) if chunk == c) for c in range(vpp)}
    assert after_last == {c: c * pp for c in range(vpp)}
    chunk_backward = 0.1 / DP_OVERLAP  # hides 0.1 s of a reduction
    assert exposed_after_cooldown([0.3, 0.5, 0.5, 0.5], chunk_backward, pp) == pytest.approx(0.3)
    # 3 x 0.9 s queued from 2.4 s before the end: 0.3 s past it, then the first chunk's 0.3 s
    assert exposed_after_cooldown([0.3, 0.9, 0.9, 0.9], chunk_backward, pp) == pytest.approx(0.6)
