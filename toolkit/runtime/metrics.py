"""Training progress: metrics.jsonl (one JSON object per logged step, every backend), the prediction a run was
launched with (run_plan.json) and whether it finished, and wandb.

Every metrics.jsonl record carries, besides loss, grad norm and learning rate, what the step cost: `step_time_s`
(wall time per optimizer step since the previous record), `tokens_per_s`, `mfu` (the plan's model FLOPs over the step
time, the GPUs and one GPU's dense peak; null where the device running has no catalogue peak), `data_wait_s` (time per
step spent waiting for the data loader) and, on GPUs only, the allocator's peaks (`gpu_max_allocated_bytes`,
`gpu_max_reserved_bytes`; with several ranks also `..._per_rank` lists).

Besides the step records, one record per complete checkpoint (`"kind": "checkpoint"`, written once its manifest is):
`step`, `checkpoint` (its directory's name), `async` (written in the background), `blocking_s` (the time training was
paused for it), `persist_s` (from the start of the save until its files and manifest were complete) and `bytes`.
`read_metrics` gives the step records, `read_checkpoint_records` these.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.estimate.timing import useful_flops_per_token
from toolkit.outputs import write_file
from toolkit.readers import read_json, read_json_lines, read_text
from toolkit.runtime.watchdog import on_exit
from toolkit.spec.cluster import get_gpu
from toolkit.spec.prediction import PackedAttention

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run_plan.json"
DISCARDED_FILE = "metrics.discarded.jsonl"  # records of steps a resume dropped (trained, then lost with their process)
PERFORMANCE_KEYS = ("step_time_s", "tokens_per_s", "mfu", "data_wait_s")
CHECKPOINT_KIND = "checkpoint"  # the `kind` of a checkpoint's record (step records have no `kind`)


@dataclass(frozen=True)
class Throughput:
    """What turns a measured step time into tokens/s and MFU."""

    tokens_per_step: int
    flops_per_step: float | None = None  # model FLOPs of one optimizer step, every rank (PaLM convention, as predicted)
    gpus: int = 1
    peak_flops: float | None = None  # one rank's dense peak at the plan's precision; None: no catalogue peak here


def trains_on_cuda(accelerator: str) -> bool:
    """Whether this process trains on a CUDA device: a recipe for GPUs where CUDA is present (elsewhere its ranks
    fall back to the CPU)."""
    import torch

    return accelerator == "gpu" and torch.cuda.is_available()


def run_throughput(model, plan, prediction: dict, accelerator: str) -> Throughput:
    """A run's Throughput: its tokens and model FLOPs per step (toolkit/estimate/timing.py's useful_flops_per_token, as
    the prediction counts them: a LoRA run's without the frozen base's weight gradients) and one rank's peak, the prediction's, but only where the run is on the device kind it was predicted for
    (a CPU run of a recipe naming an H100 has no catalogue peak: its MFU is null)."""
    tokens = plan.global_batch * plan.seq_len
    # the attention the prediction counted (a packed blend's documents), so measured and predicted MFU count alike
    flops = useful_flops_per_token(model, plan, PackedAttention.of(prediction)) * tokens
    on_cuda = trains_on_cuda(accelerator)
    peak = prediction.get("peak_tflops")
    same_kind = get_gpu(prediction["gpu"]).host != on_cuda
    return Throughput(tokens, flops, plan.gpus, peak * 1e12 if peak and same_kind else None)


class MetricsWriter:
    """Appends records; a resumed run continues the same file (steps keep increasing)."""

    def __init__(self, output_dir: Path, throughput: Throughput | int):
        self.path = Path(output_dir) / METRICS_FILE
        self.throughput = throughput if isinstance(throughput, Throughput) else Throughput(throughput)
        self._last_time: float | None = None
        self._last_step: int | None = None
        self._data_wait = 0.0
        self.pending: dict | None = None  # figures measured for a record not yet written (the HF Trainer's log)

    def mark(self, step: int) -> None:
        """Remember when `step` ended, to measure throughput up to the next record."""
        self._last_time, self._last_step, self._data_wait = time.perf_counter(), step, 0.0

    def add_data_wait(self, seconds: float) -> None:
        """Time the training loop spent waiting for its next batch."""
        self._data_wait += seconds

    def measure(self, step: int) -> dict:
        """What the steps since the previous measurement cost, per step; None where nothing was timed yet."""
        now = time.perf_counter()
        figures: dict = dict.fromkeys(PERFORMANCE_KEYS)
        if self._last_time is not None and step > self._last_step:
            steps = step - self._last_step
            step_time = (now - self._last_time) / steps
            t = self.throughput
            figures.update(step_time_s=step_time, tokens_per_s=t.tokens_per_step / step_time,
                           data_wait_s=self._data_wait / steps)
            if t.flops_per_step and t.peak_flops:
                figures["mfu"] = t.flops_per_step / (step_time * t.gpus * t.peak_flops)
        self._last_time, self._last_step, self._data_wait = now, step, 0.0
        return {**figures, **gpu_memory()}

    def write(self, step: int, loss: float, grad_norm: float | None, learning_rate: float,
              performance: dict | None = None, **extra) -> dict:
        """One record; `performance` is what measure() returned for this step (measured now when not given)."""
        figures = performance if performance is not None else self.measure(step)
        return self.append({"step": step, "loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate,
                            **figures, **extra})

    def append(self, record: dict) -> dict:
        """One line of metrics.jsonl, a non-finite figure written as null (JSON has no NaN)."""
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return record


def gpu_memory() -> dict:
    """This rank's peak CUDA allocator figures so far (what `dmt estimate` predicts, less the CUDA context); {} on
    CPU."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"gpu_max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "gpu_max_reserved_bytes": torch.cuda.max_memory_reserved()}


def gpu_memory_of_ranks() -> dict:
    """Every rank's peak allocator figures, in rank order (a collective: call it on every rank); {} on CPU or alone."""
    import sys

    torch = sys.modules.get("torch")
    mine = gpu_memory()
    if not mine or not torch.distributed.is_initialized() or torch.distributed.get_world_size() < 2:
        return {}
    dist = torch.distributed
    local = torch.tensor([mine["gpu_max_allocated_bytes"], mine["gpu_max_reserved_bytes"]], dtype=torch.int64,
                         device="cuda")
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return {"gpu_max_allocated_bytes_per_rank": [int(t[0]) for t in gathered],
            "gpu_max_reserved_bytes_per_rank": [int(t[1]) for t in gathered]}


def logged_figures(figures: dict) -> dict:
    """The numeric figures a logger (wandb, TensorBoard) takes: no None, no lists."""
    return {k: v for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _read_records(output_dir: Path, key: str | None = None) -> list[dict]:
    """Every record of metrics.jsonl (one JSON line each, through the one reader); a last line cut short (the
    writer was killed mid-write) is not a record. `key` names the flag that gave the directory."""
    path = Path(output_dir) / METRICS_FILE
    if not os.path.lexists(path):
        return []
    return read_json_lines(path, key, what=f"{METRICS_FILE}, one JSON object per line, as toolkit/train.py writes it")


def is_checkpoint_record(record: dict) -> bool:
    return record.get("kind") == CHECKPOINT_KIND


def read_metrics(output_dir: Path, key: str | None = None) -> list[dict]:
    """The step records of a run, in order."""
    return [r for r in _read_records(output_dir, key) if not is_checkpoint_record(r)]


def read_checkpoint_records(output_dir: Path, key: str | None = None) -> list[dict]:
    """The records of a run's complete checkpoints, in the order they became complete."""
    return [r for r in _read_records(output_dir, key) if is_checkpoint_record(r)]


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def start_run_record(output_dir: Path, prediction: dict, launch: dict) -> dict:
    """run_plan.json at the start of a launch: the plan and what was predicted for it (plan.json's record), where and
    how it runs, and `status: running` until end_run_record (a run killed on the way keeps saying running). The
    directory's earlier launches (a resume, a refused relaunch) stay listed under `previous_launches`."""
    earlier = read_run_record(output_dir)
    previous = []
    if earlier is not None:
        ending = {k: earlier[k] for k in ("status", "ended", "error") if k in earlier}
        previous = [*earlier.get("previous_launches", []), {**earlier.get("launch", {}), **ending}]
    record = {**prediction, "launch": {**launch, "started": _utc_now(), "host": socket.gethostname()},
              "status": "running", "previous_launches": previous}
    output_dir.mkdir(parents=True, exist_ok=True)
    write_file(output_dir / RUN_FILE, json.dumps(record, indent=2) + "\n", "--output-dir")
    return record


def end_run_record(output_dir: Path, status: str, detail: str | None = None) -> None:
    """Mark the launch in run_plan.json `completed` or `failed` (with the error's line)."""
    record = read_run_record(output_dir)
    if record is None:
        return
    record.update(status=status, ended=_utc_now(), **({"error": detail} if detail else {}))
    write_file(output_dir / RUN_FILE, json.dumps(record, indent=2) + "\n", "--output-dir")


def read_run_record(output_dir: Path, key: str | None = None) -> dict | None:
    """run_plan.json of a run directory, or None when there is none. One that cannot be read (not a JSON object, not
    a regular file, too large or too deep) is a UserInputError naming `key`, the flag that gave the directory; with no
    key (the training side, which rewrites it) it is None too."""
    path = Path(output_dir) / RUN_FILE
    if not os.path.lexists(path):
        return None
    try:
        return read_json(path, key, what=f"a {RUN_FILE} (a JSON object, as toolkit/train.py writes it)")
    except UserInputError:
        if key is not None:
            raise
        return None


def keep_until(output_dir: Path, step: int) -> None:
    """A run resumed from the checkpoint of `step`: the records of later steps (trained by the attempt that ended,
    whose updates the resume drops) move to metrics.discarded.jsonl, so that metrics.jsonl holds each step once."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return
    text, records = read_text(path, kind="jsonl"), _read_records(output_dir)  # checkpoint records go by step too
    later = [r for r in records if r["step"] > step]
    if not later and (not text or text.endswith("\n")):  # nothing later, no line cut short
        return
    with open(Path(output_dir) / DISCARDED_FILE, "a") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in later)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records if r["step"] <= step))
    os.replace(tmp, path)
    log.info("metrics.jsonl: steps %s moved to %s (the resume continues from step %d)",
             [r["step"] for r in later], DISCARDED_FILE, step)


def wandb_key_configured() -> bool:
    """An API key in WANDB_API_KEY or in the netrc file `wandb login` writes."""
    import netrc

    if os.environ.get("WANDB_API_KEY"):
        return True
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def configure_wandb(report_to: list[str], output_dir: Path) -> None:
    """With wandb in report_to: runs go under the output directory, and offline when no API key is configured
    (an explicit WANDB_MODE wins), so a training job never waits on a login prompt or the network."""
    if "wandb" not in report_to:
        return
    os.environ.setdefault("WANDB_DIR", str(output_dir))
    if "WANDB_MODE" not in os.environ and not wandb_key_configured():
        os.environ["WANDB_MODE"] = "offline"
        log.info("wandb: no API key configured, logging offline under %s", output_dir / "wandb")
    import_wandb_inside(Path(output_dir) / "wandb")


def import_wandb_inside(directory: Path) -> Path | None:
    """Import wandb with the temporary directories it makes at import (`tmp*wandb-media`, `tmp*wandb-artifacts`)
    inside `directory` (the run's own wandb directory), in one directory of this process's, removed when the rank
    ends. wandb leaves their removal to finalizers at interpreter exit, which a rank never reaches when it ends by
    exit_now (every launch under train.py, completed or failed) or is killed after Ctrl-C: they were left, empty, in
    /tmp by every such run. What a kill still leaves now stays inside the run's directory. Returns that directory
    (None: wandb was imported already, or is not installed)."""
    if "wandb" in sys.modules:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    mine = Path(tempfile.mkdtemp(prefix=f".dmt-tmp-{os.getpid()}-", dir=directory))
    previous, tempfile.tempdir = tempfile.tempdir, str(mine)
    try:
        import wandb  # noqa: F401  # lazy: wandb
    except ImportError:
        shutil.rmtree(mine, ignore_errors=True)
        return None
    finally:
        tempfile.tempdir = previous
    on_exit(lambda: shutil.rmtree(mine, ignore_errors=True))
    return mine


class WandbRun:
    """wandb for a training loop of our own (Megatron-Core; the HF Trainer has its WandbCallback): rank 0 logs every
    metrics.jsonl record under `train/`, as the HF callback names them, so both backends' runs read alike."""

    def __init__(self, name: str, output_dir: Path, config: dict):
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "huggingface"), name=name,
                               dir=str(output_dir), config=config)

    def log(self, record: dict) -> None:
        figures = logged_figures({k: v for k, v in record.items() if k != "step"})
        self._run.log({**{f"train/{k}": v for k, v in figures.items()}, "train/global_step": record["step"]})

    def finish(self) -> None:
        self._run.finish()
