"""What a profiled step costs (training.profile, toolkit/runtime/profile.py): the step time of a tiny random-init HF
Llama trained in one CPU process, steps timed in four modes: no StepProfiler at all, a StepProfiler that is off (the
default: every training loop calls it, and it must cost nothing), one recording the steps (traces, breakdown), and one
recording with `memory: true` (allocations, shapes and stacks; on CPU the memory timeline, its plot and its events).
The recording's own export (the trace, the breakdown from the events, the timeline) happens once, after its last
step, and is timed apart.

Run: python benchmarks/profile_overhead.py [--out benchmarks/profile_overhead.md] [--steps 8] [--repeats 3]
Reference: torch's profiler documentation (https://pytorch.org/docs/stable/profiler.html, torch 2.13) says recording
adds overhead and that record_shapes, profile_memory and with_stack add more; it publishes no figure for a model like
this one, so the figures here are this machine's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolkit.runtime.profile import DATA, OPTIMIZER, StepProfiler  # noqa: E402

MODES = ("no profiler", "off (default)", "recording", "recording with memory")


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _run(mode: str, steps: int, directory: Path) -> tuple[list[float], list[float], float]:
    """CPU and wall times (s) of steps 2..steps+1 (step 1 warms up), and the CPU time of the recording's export (0
    without one). The memory mode records its first 2 steps only: its timeline's export analyses every allocation
    recorded. CPU time (the process's, every thread of it: the profiler's own threads count) is what the comparison
    reads: on a machine shared with other jobs the wall time of a step moves by tens of per cent with their load."""
    import torch

    model, optimizer = _model()
    profiler = None
    if mode != "no profiler":
        recording = mode.startswith("recording")
        last = min(steps + 1, 3) if mode.endswith("memory") else steps + 1
        profiler = StepProfiler(directory, 0, first=2 if recording else 0, last=last if recording else -1,
                                memory=mode.endswith("memory"), active=recording)
    times, walls = [], []
    generator = torch.Generator().manual_seed(1)
    for step in range(1, (min(steps + 1, 3) if mode.endswith("memory") else steps + 1) + 1):
        start, wall = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.begin_step(step)
        with profiler.span(DATA) if profiler is not None else _nothing():
            tokens = torch.randint(0, 1024, (8, 128), generator=generator)
        model(input_ids=tokens, labels=tokens).loss.backward()
        if profiler is not None:
            profiler.enter(OPTIMIZER)
        optimizer.step()
        optimizer.zero_grad()
        if profiler is not None:
            profiler.leave(OPTIMIZER)
        times.append(time.process_time() - start)
        walls.append(time.perf_counter() - wall)
    export = time.process_time()
    if profiler is not None:
        profiler.close()
    return times[1:], walls[1:], time.process_time() - export


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    wall_results: dict[str, list[float]] = {mode: [] for mode in MODES}
    exports: dict[str, list[float]] = {mode: [] for mode in MODES}
    load = os.getloadavg()[0]
    for repeat in range(args.repeats):  # the modes interleaved, so a change of the machine's load falls on all
        for mode in MODES if repeat == 0 else MODES[:-1]:  # the memory mode once: its export is the slowest
            with tempfile.TemporaryDirectory() as directory:
                times, walls, export = _run(mode, args.steps, Path(directory))
            results[mode].append(statistics.median(times))
            wall_results[mode].append(statistics.median(walls))
            exports[mode].append(export)
    base = statistics.median(results["no profiler"])
    lines = ["# Profiled steps: what recording costs", "",
             f"Generated by `benchmarks/profile_overhead.py` (`--steps {args.steps} --repeats {args.repeats}`) on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. No GPU was lent to this task.", "",
             f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python "
             f"{platform.python_version()}, torch {torch.__version__}, 1 thread, load average {load:.1f} before "
             f"the runs (a machine shared with other developers' runs)",
             "model: random-init HF Llama (hidden 256, 4 layers, vocab 1024), batch 8 x 128 tokens, AdamW, one "
             "CPU process; a step's time = its CPU time (the process's, all threads), median of the steps after the "
             "first, median over the repeats (the memory mode: 2 recorded steps, once); wall time beside it, "
             f"which the machine's other load moves (load average {os.getloadavg()[0]:.1f} after the runs)", "",
             "| mode | CPU s a step | vs no profiler | wall s a step | export after the window, CPU s |",
             "|---|---:|---:|---:|---:|"]
    for mode in MODES:
        step = statistics.median(results[mode])
        lines.append(f"| {mode} | {step:.4f} | {step / base - 1:+.1%} | {statistics.median(wall_results[mode]):.4f} "
                     f"| {statistics.median(exports[mode]):.2f} |")
    lines += ["", "The export runs inside the first step after the window (on_trace_ready): that step is longer by it, "
              "and a recording with memory must end well within training.hang_timeout_s.",
              "", "Reference: torch's profiler documentation (https://pytorch.org/docs/stable/profiler.html) names "
              "the overhead and publishes no figure for this setting; the figures above are this machine's."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
