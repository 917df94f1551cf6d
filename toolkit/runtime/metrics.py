"""Training progress: metrics.jsonl (one JSON object per logged step, both backends) and wandb's mode."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
DISCARDED_FILE = "metrics.discarded.jsonl"  # records of steps a resume dropped (trained, then lost with their process)


class MetricsWriter:
    """Appends records; a resumed run continues the same file (steps keep increasing)."""

    def __init__(self, output_dir: Path, tokens_per_step: int):
        self.path = Path(output_dir) / METRICS_FILE
        self.tokens_per_step = tokens_per_step
        self._last_time: float | None = None
        self._last_step: int | None = None

    def mark(self, step: int) -> None:
        """Remember when `step` ended, to measure throughput up to the next record."""
        self._last_time, self._last_step = time.perf_counter(), step

    def write(self, step: int, loss: float, grad_norm: float | None, learning_rate: float, **extra) -> dict:
        now = time.perf_counter()
        tokens_per_s = None
        if self._last_time is not None and step > self._last_step:
            tokens_per_s = self.tokens_per_step * (step - self._last_step) / (now - self._last_time)
        self._last_time, self._last_step = now, step
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate,
                  "tokens_per_s": tokens_per_s, **gpu_memory(), **extra}
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}  # JSON
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return record


def gpu_memory() -> dict:
    """This rank's peak CUDA allocator figures so far (what `dmt estimate` predicts, less the CUDA context); {} on CPU."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"gpu_max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "gpu_max_reserved_bytes": torch.cuda.max_memory_reserved()}


def read_metrics(output_dir: Path) -> list[dict]:
    """The records of a run; a last line cut short (the writer was killed mid-write) is not a record."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines = lines[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def keep_until(output_dir: Path, step: int) -> None:
    """A run resumed from the checkpoint of `step`: the records of later steps (trained by the attempt that ended,
    whose updates the resume drops) move to metrics.discarded.jsonl, so that metrics.jsonl holds each step once."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return
    text, records = path.read_text(), read_metrics(output_dir)
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
