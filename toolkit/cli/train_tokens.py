"""`--train-tokens` of `dmt estimate` and `dmt plan`: a token budget (15T, 1.5e12, 300B) turned into days and
GPU-hours next to each record (`training_time`), only when given, so the JSON is unchanged otherwise; failure-free
and with the checkpoints and failures the flags beside it assume (their defaults and sources live in
toolkit/estimate/goodput.py and checkpoint_cost.py)."""

from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING

from toolkit.estimate.checkpoint_cost import WRITE_BW_GBPS_PER_NODE
from toolkit.estimate.goodput import FAILURE_RATE_PER_GPU_HOUR, RESTART_MODES
from toolkit.estimate.training_time import FailureInputs, record_training_time
from toolkit.numeric import (
    FAILURE_RATE,
    PRICE,
    RESTART,
    WRITE_BW,
    WRITE_TIME,
    token_count,
)

if TYPE_CHECKING:
    from toolkit.estimate.training_time import FailureInputs
    from toolkit.spec.prediction import Prediction

# decimal multipliers, as token budgets are quoted ("15T tokens" = 15e12)
MULTIPLIERS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12, "P": 10**15}
_TOKENS = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGTP]?)\s*", re.IGNORECASE)


def parse_token_count(text: str) -> int:
    """15T, 1.5e12, 300B, 2000000 -> tokens; argparse names the flag in the one-line error."""
    match = _TOKENS.fullmatch(str(text))
    return token_count(float(match.group(1)) * MULTIPLIERS[match.group(2).upper()] if match else math.nan, str(text))


def add_train_tokens_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-tokens", type=parse_token_count, default=None, metavar="N",
                        help="training budget in tokens (15T, 300B, 1.5e12): adds wall-clock days and GPU-hours, "
                             "failure-free and with checkpoints and failures")
    parser.add_argument("--failure-rate", type=FAILURE_RATE, default=FAILURE_RATE_PER_GPU_HOUR, metavar="PER_GPU_HOUR",
                        help="interruptions per GPU-hour, with --train-tokens (default %(default).3g: Llama 3 405B's "
                             "419 in 54 days on 16,384 GPUs, arXiv:2407.21783 Sec. 3.3.4; 0: none)")
    parser.add_argument("--restart", choices=tuple(RESTART_MODES), default="relaunch",
                        help="how a failed job restarts (training.restart), which sets --restart-s's default: "
                             "relaunch (every process again), in_process (NVRx's in-process restart, docs/faults.md)")
    defaults = ", ".join(f"{mode} {seconds:g}" for mode, seconds in RESTART_MODES.items())
    parser.add_argument("--restart-s", type=RESTART, default=None, metavar="S",
                        help=f"seconds from a failure to training again, before the checkpoint is reloaded (default "
                             f"by --restart: {defaults}; relaunch: an assumption, Daly's R = 10 min; in_process: "
                             f"benchmarks/restart_time.md; pass a measured one)")
    parser.add_argument("--local-checkpoint", action="store_true",
                        help="a restart reloads node-local checkpoints (checkpoint.local) at the host link instead "
                             "of shared storage at --checkpoint-write-bw")
    parser.add_argument("--checkpoint-write-bw", type=WRITE_BW, default=WRITE_BW_GBPS_PER_NODE, metavar="GBPS",
                        help="checkpoint storage GB/s per node, writing and reading (default %(default).3g: Llama 3's "
                             "2 TB/s sustained over 2,048 nodes, arXiv:2407.21783 Sec. 3.3.1)")
    parser.add_argument("--checkpoint-write-s", type=WRITE_TIME, default=None, metavar="S",
                        help="a measured write time of one checkpoint, instead of its bytes over the bandwidth")
    parser.add_argument("--async-checkpoint", action=argparse.BooleanOptionalAction, default=None,
                        help="asynchronous saves block training only for the copy of each GPU's states to host "
                             "memory; --no-async-checkpoint: for the whole write (default: as the plan's backend "
                             "saves today: async on Megatron-Core, sync on DeepSpeed and FSDP2)")
    parser.add_argument("--gpu-hour-price", type=PRICE, default=None, metavar="PRICE",
                        help="price of one GPU-hour: adds training_time.cost (GPU-hours with failures x price)")


def failure_inputs(args: argparse.Namespace) -> FailureInputs:
    """The failure and checkpoint assumptions the flags give (their ranges checked as argparse parses them)."""
    return FailureInputs(failure_rate_per_gpu_hour=args.failure_rate, restart=args.restart, restart_s=args.restart_s,
                         local_checkpoint=args.local_checkpoint,
                         write_bw_gbps_per_node=args.checkpoint_write_bw, write_s=args.checkpoint_write_s,
                         async_save=args.async_checkpoint, gpu_hour_price=args.gpu_hour_price)


def add_training_time(records: list[Prediction], args: argparse.Namespace) -> None:
    """Attach `training_time` to every record when a budget was given (--train-tokens)."""
    if args.train_tokens is None:
        return
    inputs = failure_inputs(args)
    for record in records:
        record.training_time = record_training_time(record, args.train_tokens, inputs)


def training_time_lines(record: Prediction) -> list[str]:
    t = record.training_time
    c, lost = t.checkpoint, t.lost_h
    mode = "async: the copy to host memory" if c.async_save else "sync: the whole write"
    failures = (f"one interruption every {t.mtbf_h:,.1f} h on {record.plan.gpus} GPUs "
                f"({t.failure_rate_per_gpu_hour:.3g} per GPU-hour): {t.interruptions:,.1f} expected"
                if t.mtbf_h is not None else "no failures (--failure-rate 0)")
    lines = [
        f"training on {t.tokens:.4g} tokens: {t.steps:,} steps, {t.days_compute:,.1f} days, "
        f"{t.gpu_hours_compute:,.0f} GPU-hours on {record.plan.gpus} x {record.gpu} without failures",
        f"checkpoint: {c.bytes / 1e9:,.1f} GB per save, written in {c.write_s:,.3g} s, blocking {c.blocking_s:,.3g} s "
        f"({mode}); every {c.interval_steps:,} steps ({c.interval_s / 60:,.1f} min, Daly's optimum)",
        f"{failures}; lost: checkpoints {lost.checkpoints:,.1f} h, restarts {lost.restarts:,.1f} h "
        f"({t.restart}, {t.restart_s:,.3g} s each), reloads {lost.reloads:,.1f} h "
        f"({'node-local' if c.local else 'shared storage'}, {c.reload_s:,.3g} s each), "
        f"recomputed steps {lost.recomputed:,.1f} h",
        f"with failures: {t.days:,.1f} days, {t.gpu_hours:,.0f} GPU-hours, goodput {t.goodput:.1%}"
        + (f", cost {t.cost:,.0f}" if t.cost is not None else ""),
    ]
    return lines
