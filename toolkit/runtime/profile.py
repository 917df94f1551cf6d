"""Profiled steps (recipe `training.profile`, train.py --profile-steps A-B): torch.profiler on the chosen steps and
ranks with its own schedule, each rank's trace written to RUN_DIR/profile/ (Chrome/Perfetto JSON, the file name
TensorBoard's profiler and Holistic Trace Analysis read: rank<R>.<first step>.pt.trace.json), the memory recording when
asked, and the step's measured breakdown (profile/breakdown/rank<R>.json) taken from the profiler's own events when
the recording ends.

The memory recording (`memory: true`) is torch's own, in the form torch 2.13 supports on the rank's device. On a CPU
rank: the profiler's memory timeline (allocations recorded with shapes and stacks, then categorised by torch), as a
plot (rank<R>.memory.html) and as its raw events (memory/rank<R>.json); torch 2.13 deprecates that export but has no
other for CPU memory (toolkit/compat/torch_seams.py). On a GPU rank: the CUDA caching allocator's history over the
recorded steps, the replacement torch names, as the snapshot pytorch.org/memory_viz opens (rank<R>.memory.pickle).

The breakdown partitions each profiled step (the profiler's ProfilerStep#N range on the training thread) into
checkpoint pause, data wait, exposed communication, optimizer, compute and idle, in that priority: a moment of the
training thread inside a `dmt.checkpoint` range is checkpoint time whatever runs in it, and so on down (compute is the
time inside ATen operators, not the ranges around them: those may hold a wait, as DDP's backward does); a moment with
no event on the training thread is exposed communication when a collective runs on another thread (gloo's and NCCL's
work threads), idle otherwise. So the terms add up to the step by construction; communication on another thread while
the training thread is busy is reported apart as overlapped. The ranges are the profiler's (`record_function`), opened
by the training loops around their data fetch, optimizer step and checkpoint save (`span`, `enter`/`leave`).
Off (no profile, or another rank), every method returns at once: no profiler is built."""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import re
from pathlib import Path

from toolkit.compat.torch_seams import dump_cuda_memory_snapshot, memory_timeline, record_cuda_memory_history
from toolkit.outputs import write_file

log = logging.getLogger(__name__)
PROFILE_DIR = "profile"
TRACE_SUFFIX = ".pt.trace.json"  # TensorBoard's profiler plugin reads <worker>[.<span>].pt.trace.json
# beside the traces, not among them: Holistic Trace Analysis reads every .json of the directory as a trace
BREAKDOWN_FILE = "breakdown/rank{rank}.json"
MEMORY_PLOT, MEMORY_EVENTS_FILE = "rank{rank}.memory.html", "memory/rank{rank}.json"  # CPU ranks (events: not a trace)
MEMORY_SNAPSHOT = "rank{rank}.memory.pickle"  # GPU ranks
# the allocation events a GPU rank's history keeps (several KB each, the oldest dropped first): the bound PyTorch's
# memory snapshot guide uses (https://pytorch.org/blog/understanding-gpu-memory-1/, MAX_NUM_OF_MEM_EVENTS_PER_SNAPSHOT)
MEMORY_HISTORY_ENTRIES = 100_000
# the training loops' ranges (record_function names)
DATA, OPTIMIZER, CHECKPOINT = "dmt.data", "dmt.optimizer", "dmt.checkpoint"
# the measured terms, in the order a moment of the training thread is attributed (the first that covers it wins)
TERMS = ("checkpoint_s", "data_wait_s", "communication_exposed_s", "optimizer_s", "compute_s", "idle_s")
STEP_EVENT = re.compile(r"^ProfilerStep[#*]")  # prof.events() names every step ProfilerStep*, the trace #N
# a collective as torch.profiler names it: gloo's and NCCL's work (gloo:all_reduce, nccl:all_reduce), c10d's ops on the
# calling thread (c10d::allreduce_), DeepSpeed's and others' communication records (record_param_comms), NCCL kernels
COLLECTIVE = re.compile(r"^(gloo:|nccl:|c10d::|record_param_comms|ncclDevKernel|ncclKernel)")
MEMORY_EVENT = "[memory]"  # an allocation (profile_memory): an instant, not a call
_OFF = contextlib.nullcontext()


def parse_step_range(text: str) -> tuple[int, int]:
    """--profile-steps: 'A-B' (or 'A', one step) -> (A, B), 1 <= A <= B; ValueError names what is valid."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text or "")
    if match is None:
        raise ValueError(f"got {text!r}; valid: A-B, the first and last step to record (1 <= A <= B), e.g. 3-4")
    first, last = int(match.group(1)), int(match.group(2) or match.group(1))
    if not 1 <= first <= last:
        raise ValueError(f"got {text!r}; valid: A-B with 1 <= A <= B, e.g. 3-4")
    return first, last


class StepProfiler:
    """One per rank. `begin_step(s)` at the start of every trained step (before its data is fetched), `close()` when
    training ends; `span(name)` / `enter(name)`, `leave(name)` mark the loop's phases in the trace."""

    def __init__(self, output_dir: Path, rank: int, first: int, last: int, memory: bool = False,
                 active: bool = True):
        self.directory, self.rank = Path(output_dir) / PROFILE_DIR, rank
        self.first, self.last, self.memory, self.active = first, last, memory, active
        self._profiler = None
        self._launch_step: int | None = None  # the first step this launch trained (a resume starts later)
        self._cuda_history = False  # a GPU rank's allocator history is on
        self._open: dict[str, object] = {}
        self.written: list[Path] = []

    @classmethod
    def from_recipe(cls, recipe, output_dir: Path, rank: int) -> "StepProfiler":
        settings = recipe.training.profile
        if settings is None:
            return cls(output_dir, rank, 0, -1, active=False)
        chosen = settings.ranks is None or rank in settings.ranks
        return cls(output_dir, rank, settings.start_step, settings.last_step, settings.memory, active=chosen)

    def begin_step(self, step: int) -> None:
        if not self.active:
            return
        for name in list(self._open):  # a range a hook opened and none closed ends with its step
            self.leave(name)
        if self._profiler is None:
            if step > self.last:  # resumed past the window: nothing to record in this launch
                self.active = False
                return
            self._start(step)
        elif step > self.last + 1:  # the window's trace is out (on_trace_ready ran at the step after it): stop
            self.close()
            return
        else:
            self._profiler.step()
        if self.memory and step == max(self.first, self._launch_step) and _on_cuda():
            self._start_cuda_history()  # from the first recorded step, as the profiler records

    def _start(self, step: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        self._launch_step = step
        lead = max(self.first - step, 0)  # profiler steps before the first recorded one: one of them warms it up
        active = self.last - max(self.first, step) + 1
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.directory.mkdir(parents=True, exist_ok=True)
        self._profiler = profile(activities=activities,
                                 schedule=schedule(wait=max(lead - 1, 0), warmup=min(lead, 1), active=active,
                                                   repeat=1),
                                 on_trace_ready=self._ready, profile_memory=self.memory, record_shapes=self.memory,
                                 with_stack=self.memory)
        self._profiler.start()

    def span(self, name: str):
        """A context manager: the range `name` in the trace while a recording runs (nothing otherwise)."""
        if self._profiler is None:
            return _OFF
        from torch.profiler import record_function

        return record_function(name)

    def enter(self, name: str) -> None:
        """Open the range `name` where a loop's hooks bracket a phase (HF Trainer's callbacks); `leave` closes it."""
        if self._profiler is None or name in self._open:
            return
        from torch.profiler import record_function

        self._open[name] = record_function(name)
        self._open[name].__enter__()

    def leave(self, name: str) -> None:
        scope = self._open.pop(name, None)
        if scope is not None:
            scope.__exit__(None, None, None)

    def close(self) -> None:
        """The end of training (or of the window): what the window recorded is written now."""
        for name in list(self._open):
            self.leave(name)
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
        self._stop_cuda_history()
        self.active = False

    def _ready(self, profiler) -> None:
        """on_trace_ready: the trace, the memory timeline and the breakdown of this rank's recorded steps."""
        try:
            first = max(self.first, self._launch_step or self.first)
            trace = self.directory / f"rank{self.rank}.{first}{TRACE_SUFFIX}"
            temporary = trace.with_name(f".{trace.name}.{os.getpid()}.tmp")
            profiler.export_chrome_trace(str(temporary))
            os.replace(temporary, trace)
            self.written.append(trace)
            if self.memory:
                self._memory_timeline(profiler)
            steps = step_breakdowns(profiler.events(), first)
            body = {"rank": self.rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                    "device": "cuda" if _on_cuda() else "cpu", "trace": trace.name, "steps": steps}
            path = self.directory / BREAKDOWN_FILE.format(rank=self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, json.dumps(body, indent=2) + "\n", "training.profile")
            self.written.append(path)
            log.info("profile: steps %d-%d of rank %d in %s", first, self.last, self.rank, trace)
        except Exception:  # a profile that cannot be written must not end the training run
            log.exception("profile: could not write the recording of rank %d", self.rank)

    def _memory_timeline(self, profiler) -> None:
        try:
            if _on_cuda():
                paths = [self.directory / MEMORY_SNAPSHOT.format(rank=self.rank)]
                dump_cuda_memory_snapshot(paths[0])
            else:
                paths = [self.directory / name.format(rank=self.rank) for name in (MEMORY_PLOT, MEMORY_EVENTS_FILE)]
                paths[1].parent.mkdir(parents=True, exist_ok=True)
                memory_timeline(profiler, *paths, device="cpu")
            self.written += [path for path in paths if path.exists()]  # no plot without matplotlib
        except Exception as exc:  # the memory recording is an extra: the trace and breakdown still count
            log.warning("profile: no memory recording for rank %d: %s", self.rank, exc)
        finally:
            self._stop_cuda_history()

    def _start_cuda_history(self) -> None:
        try:
            record_cuda_memory_history(MEMORY_HISTORY_ENTRIES)
            self._cuda_history = True
        except Exception as exc:  # as a recording that cannot be written: training goes on without it
            log.warning("profile: no allocator history for rank %d: %s", self.rank, exc)

    def _stop_cuda_history(self) -> None:
        if self._cuda_history:
            self._cuda_history = False
            record_cuda_memory_history(None)


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def step_breakdowns(events, first_step: int) -> list[dict]:
    """Each recorded step's terms (seconds) from torch.profiler's events (prof.events(): FunctionEvent with name,
    thread and time_range in microseconds), in order from `first_step`, the first step recorded."""
    steps = sorted((e for e in events if STEP_EVENT.match(e.name)), key=lambda e: e.time_range.start)
    if not steps:
        return []
    main = steps[0].thread
    ranges: dict[str, list] = {term: [] for term in TERMS}
    elsewhere = []  # collectives on other threads
    for event in events:
        name, span = event.name, (event.time_range.start, event.time_range.end)
        if STEP_EVENT.match(name) or span[1] <= span[0]:
            continue
        if event.thread != main:
            if COLLECTIVE.match(name):
                elsewhere.append(span)
            continue
        term = _term_of(name)
        if term != "compute_s" or _operator(event):
            ranges[term].append(span)
    merged = {term: _merge(spans) for term, spans in ranges.items()}
    others = _merge(elsewhere)
    return [{"step": first_step + index, **_partition((e.time_range.start, e.time_range.end), merged, others)}
            for index, e in enumerate(steps)]


def _operator(event) -> bool:
    """Compute: an ATen operator, or an event that calls no other; not the ranges around them (an autograd node, a
    module's forward), which can hold a wait: DDP's backward waits for its gradient all-reduce inside one."""
    return event.name.startswith("aten::") or not any(child.name != MEMORY_EVENT for child in event.cpu_children)


def _term_of(name: str) -> str:
    if name.startswith(CHECKPOINT):
        return "checkpoint_s"
    if name.startswith(DATA):
        return "data_wait_s"
    if COLLECTIVE.match(name):
        return "communication_exposed_s"
    if name.startswith(OPTIMIZER) or name.startswith("Optimizer.step#"):
        return "optimizer_s"
    return "compute_s"


def _merge(spans: list) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _covers(spans: list[tuple[float, float]], moment: float) -> bool:
    index = bisect.bisect_right(spans, (moment, float("inf"))) - 1
    return index >= 0 and spans[index][0] <= moment < spans[index][1]


def _partition(window: tuple[float, float], merged: dict[str, list], others: list) -> dict:
    """Split `window` (microseconds) into the terms: each elementary interval between two event edges goes to the
    first term covering it; uncovered, to exposed communication where another thread runs a collective, else idle."""
    start, end = window
    edges = {start, end}
    for spans in (*merged.values(), others):
        for a, b in spans:
            if b > start and a < end:
                edges.update((max(a, start), min(b, end)))
    points = sorted(edges)
    seconds = dict.fromkeys(TERMS, 0.0)
    overlapped = 0.0
    for a, b in zip(points, points[1:]):
        middle, length = (a + b) / 2, (b - a) / 1e6
        term = next((t for t in TERMS[:-1] if _covers(merged[t], middle)), None)
        on_other_thread = _covers(others, middle)
        if term is None:
            term = "communication_exposed_s" if on_other_thread else "idle_s"
        elif on_other_thread and term != "communication_exposed_s":
            overlapped += length
        seconds[term] += length
    step_s = (end - start) / 1e6
    return {"step_s": step_s, **seconds, "communication_overlapped_s": overlapped}
