"""Megatron-Core's own pipeline schedules timed on CPU ranks, against the step model's pipeline terms.

Run: .venv/bin/python benchmarks/pipeline_schedule_cpu.py [--write benchmarks/pipeline_schedule_cpu.md]
Each rank of a pp-stage pipeline (gloo over loopback, toolkit.compat.megatron_cpu) runs Megatron-Core 0.16's
get_forward_backward_func() (1F1B, or the interleaved schedule with vpp chunks) over m micro-batches of a model
whose every virtual stage sleeps its forward (1/3 of its work) and its backward (2/3); the last virtual stage, which
carries the head and the loss in a real model, does `head` more. The measured step is compared with
m x (the slowest rank's micro-batch) + pipeline_bubble_s (toolkit/estimate/timing.py), and with the old
(m + (p-1)/v) x slowest. Transfers are a few bytes (the schedule's order is what is measured); the equal-stage run of
each (pp, vpp) shows the harness's own overhead (sleep overshoot, gloo's p2p, process scheduling on a loaded host).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEQ, MICRO_BATCH, HIDDEN = 4, 1, 8
UNIT_S = 0.1  # one virtual stage's forward + backward per micro-batch
CASES = [(4, 1, 8, 0.0), (4, 1, 8, 0.5), (4, 2, 8, 0.0), (4, 2, 8, 0.5)]  # (pp, vpp, micro-batches, head)


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, backward_s):
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None


class SleepingStage(torch.nn.Module):
    """A model chunk as the schedules see it: set_input_tensor, a config, a model type; its work is a sleep."""

    def __init__(self, config, work_s: float):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config, self.model_type = config, ModelType.encoder_or_decoder
        self.forward_s, self.backward_s = work_s / 3, 2 * work_s / 3
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.input = None

    def set_input_tensor(self, tensor):
        self.input = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x):
        time.sleep(self.forward_s)
        return SleepInBackward.apply((x if self.input is None else self.input) * self.weight, self.backward_s)


def _rank(rank: int, pp: int, vpp: int, micro_batches: int, work: list[float], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=pp)
    from toolkit.compat.megatron_cpu import cuda_on_cpu

    with cuda_on_cpu():
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer import TransformerConfig

        virtual = vpp if vpp > 1 else None
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                                 virtual_pipeline_model_parallel_size=virtual)
        config = TransformerConfig(num_layers=pp * vpp, hidden_size=HIDDEN, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=virtual,
                                   pipeline_dtype=torch.float32)
        chunks = [SleepingStage(config, work[chunk * pp + rank]) for chunk in range(vpp)]
        data = [torch.ones(SEQ, MICRO_BATCH, HIDDEN, requires_grad=True) for _ in range(micro_batches)]

        def forward_step(data_iterator, model):
            output = model(next(data_iterator))
            return output, lambda o: (o.sum(), {"loss": o.detach().sum()})

        schedule, best = get_forward_backward_func(), float("inf")
        for _ in range(3):
            iterators = [iter(data) for _ in chunks] if vpp > 1 else iter(data)
            dist.barrier()
            start = time.perf_counter()
            schedule(forward_step_func=forward_step, data_iterator=iterators, model=chunks if vpp > 1 else chunks[0],
                     num_microbatches=micro_batches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)
            dist.barrier()
            best = min(best, time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(json.dumps(best))
    dist.destroy_process_group()


def measure(pp: int, vpp: int, micro_batches: int, head: float) -> float:
    work = [UNIT_S] * (pp * vpp)
    work[-1] *= 1 + head
    with socket.socket() as s, tempfile.TemporaryDirectory() as tmp:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out = f"{tmp}/seconds.json"
        s.close()
        mp.spawn(_rank, args=(pp, vpp, micro_batches, work, port, out), nprocs=pp)
        return json.loads(Path(out).read_text())


def modelled(pp: int, vpp: int, micro_batches: int, head: float) -> tuple[float, float]:
    """(the step model's pipeline terms, the old (m + (p-1)/v) x slowest), transfers taken as free."""
    from toolkit.estimate.timing import pipeline_bubble_s
    from toolkit.spec.model import load_model_spec
    from toolkit.spec.plan import resolve_plan

    plan = resolve_plan(load_model_spec("llama-3.2-1b"), pp, backend="megatron", pp=pp, vpp=vpp, seq_len=2048,
                        global_batch=micro_batches)
    micro = {stage: UNIT_S * vpp for stage in range(pp)}
    micro[pp - 1] += UNIT_S * head
    slowest = max(micro.values())
    return micro_batches * slowest + pipeline_bubble_s(plan, micro), (micro_batches + (pp - 1) / vpp) * slowest


def report() -> str:
    lines = [f"machine: {platform.machine()} python {platform.python_version()}, {os.cpu_count()} CPUs, load "
             f"{os.getloadavg()[0]:.1f}; a virtual stage's work {UNIT_S} s a micro-batch, best of 3 steps", "",
             "| pp | vpp | micro-batches | last stage's extra | measured s | step model s | error | old formula s | "
             "error |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for pp, vpp, m, head in CASES:
        seconds = measure(pp, vpp, m, head)
        model, old = modelled(pp, vpp, m, head)
        lines.append(f"| {pp} | {vpp} | {m} | {head:.0%} | {seconds:.3f} | {model:.3f} | {model / seconds - 1:+.1%} "
                     f"| {old:.3f} | {old / seconds - 1:+.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also write the report (markdown) to this file")
    args = parser.parse_args()
    text = report()
    print(text, end="")
    if args.write:
        args.write.write_text("# Megatron-Core's pipeline schedules on CPU against the step model\n\nGenerated by "
                              "`benchmarks/pipeline_schedule_cpu.py`.\n\n" + text + NOTES)


NOTES = """
The equal-stage rows measure the harness's own overhead (sleep overshoot and gloo's p2p on a shared 2-core host,
a few percent short in both formulas alike): read the other rows against the equal-stage row of the same (pp, vpp).
1F1B with a heavier last stage: the step model (the extra paid m times, the fill and drain at the other stages'
pace) lands where the equal-stage row does, the old (m + p - 1) x slowest, which paid the extra p - 1 more times,
about 10 points above it. Interleaved: the bubble is (p-1)/v micro-batches (the equal-stage row), and with a heavier
last chunk the measured step sits between the two formulas, nearer the step model's.
"""


if __name__ == "__main__":
    main()
