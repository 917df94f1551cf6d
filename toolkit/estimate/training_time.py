"""Wall-clock days and GPU-hours of a whole training run, from a plan's predicted step time and a token budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toolkit.spec.prediction import Prediction

SECONDS_PER_HOUR = 3600
SECONDS_PER_DAY = 86400


def training_time(tokens: int, step_time_s: float, tokens_per_step: int, gpus: int) -> dict:
    """{tokens, steps, days, gpu_hours}: whole optimizer steps (the last one full) at the predicted step time."""
    steps = -(-tokens // tokens_per_step)
    seconds = steps * step_time_s
    return {"tokens": tokens, "steps": steps, "days": seconds / SECONDS_PER_DAY,
            "gpu_hours": seconds * gpus / SECONDS_PER_HOUR}


def record_training_time(record: Prediction, tokens: int) -> dict:
    """training_time() of one prediction (`dmt estimate`, a plan of `dmt plan`)."""
    plan = record.plan
    return training_time(tokens, record.step_time_s, plan.global_batch * plan.seq_len, plan.gpus)
