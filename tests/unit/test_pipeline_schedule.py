"""The pipeline terms of the step model (bubble, point-to-point exchanges) against an event-driven run of Megatron-Core's
1F1B order (forward_backward_pipelining_without_interleaving, megatron/core/pipeline_parallel/schedules.py), with
stages of unequal work: the last one carries the head and the loss, the first the embedding."""

from __future__ import annotations

import pytest

from toolkit.estimate.timing import pipeline_bubble_s, pipeline_exchanges
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
