"""metrics.jsonl: one JSON object per logged step (step, loss, grad_norm, learning_rate, tokens_per_s), both backends."""

from __future__ import annotations

import json
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


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
                  "tokens_per_s": tokens_per_s, **extra}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return record


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
