"""`--train-tokens` of `dmt estimate` and `dmt plan`: a token budget (15T, 1.5e12, 300B) turned into days and
GPU-hours next to each record (`training_time`), only when given, so the JSON is unchanged otherwise."""

from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toolkit.spec.prediction import Prediction

# decimal multipliers, as token budgets are quoted ("15T tokens" = 15e12)
MULTIPLIERS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12, "P": 10**15}
_TOKENS = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGTP]?)\s*$", re.IGNORECASE)


def parse_token_count(text: str) -> int:
    """15T, 1.5e12, 300B, 2000000 -> tokens; argparse names the flag in the one-line error."""
    match = _TOKENS.match(str(text))
    value = float(match.group(1)) * MULTIPLIERS[match.group(2).upper()] if match else math.nan
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"expected a positive token count such as 15T, 300B or 1.5e12, got {text!r}")
    return round(value)


def add_train_tokens_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-tokens", type=parse_token_count, default=None, metavar="N",
                        help="training budget in tokens (15T, 300B, 1.5e12): adds wall-clock days and GPU-hours")


def add_training_time(records: list[Prediction], tokens: int | None) -> None:
    """Attach `training_time: {tokens, steps, days, gpu_hours}` to every record when a budget was given."""
    from toolkit.estimate.training_time import record_training_time

    if tokens is None:
        return
    for record in records:
        record.training_time = record_training_time(record, tokens)


def training_time_line(record: Prediction) -> str:
    t = record.training_time
    return (f"training on {t.tokens:.4g} tokens: {t.steps:,} steps, {t.days:,.1f} days, "
            f"{t.gpu_hours:,.0f} GPU-hours on {record.plan.gpus} x {record.gpu}")
