"""`dmt plan`: every valid plan for a model on a cluster, its memory and predicted step time, fastest first."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from toolkit.cli.common import (
    add_network_arguments,
    add_plan_arguments,
    build_network,
    calibration_for,
    calibration_line,
    check_max_seq_len,
    plan_gpu,
)
from toolkit.cli.console import console as make_console
from toolkit.cli.options import FINETUNE, plan_overrides
from toolkit.cli.paths import output_arg
from toolkit.cli.train_tokens import add_train_tokens_argument, add_training_time, failure_inputs
from toolkit.errors import UserInputError
from toolkit.estimate.memory import estimate_memory
from toolkit.numeric import GiB, bounded_int, json_text
from toolkit.outputs import output_file
from toolkit.planner.max_seq_len import longest_plans
from toolkit.planner.plot import write_memory_plot
from toolkit.planner.predict import MFU_NOTE, plan_label, plan_record
from toolkit.planner.search import rank_by_training_days, search, why_first_beats_second
from toolkit.planner.tuned_layouts import against_tuned
from toolkit.spec.backends import NAMES, backend_of
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import load_model_spec
from toolkit.spec.options import PlanOptions
from toolkit.spec.plan import finetune_options, resolve_plan, validated
from toolkit.spec.prediction import RankedPlans

if TYPE_CHECKING:
    from toolkit.planner.search import Candidate
    from toolkit.spec.cluster import GPU
    from toolkit.spec.model import ModelSpec
    from toolkit.spec.prediction import RankedPlans


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser, required=("global_batch",))  # any other plan option given is pinned
    parser.add_argument("--backends", default=None, metavar=",".join(NAMES),
                        help="search only these backends (default: all; --backend pins one)")
    parser.add_argument("--top", type=bounded_int, default=10, help="plans to show (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: the ranked plans, the rejected "
                                                              "candidates by reason, the calibration used")
    parser.add_argument("--plot", type=output_arg, default=None, metavar="FILE.png",
                        help="stacked per-GPU memory of the top plans and of ZeRO 0-3")
    parser.add_argument("--explain", action="store_true",
                        help="also compare the winner with NVIDIA's tuned published layout of the same model, cluster "
                             "and batch where there is one, naming the step-time terms that set them apart")
    add_network_arguments(parser)
    add_train_tokens_argument(parser)


@dataclass
class PlanOutcome:
    """What `dmt plan` found: the record it prints with --json (and `dmt explore` answers), and what its table, its
    plot and its `winner:` line are drawn from."""

    record: RankedPlans
    model: ModelSpec
    gpu: GPU
    top: list[Candidate]  # the ranked plans the record holds, as the search returned them
    network: object = None  # the Network the search priced communication on
    backends: tuple[str, ...] = ()  # the backends searched


def plan_results(args: argparse.Namespace) -> PlanOutcome:
    """The search `dmt plan`'s arguments ask for, its --top plans and why the other layouts were left out."""
    if args.top < 1:
        raise UserInputError("--top", f"must be at least 1, got {args.top}")
    pinned = plan_overrides(args)
    if args.gpus < 1:  # checked here: the search would otherwise reject every candidate and print an empty table
        raise UserInputError("--gpus", f"must be a positive integer, got {args.gpus}")
    validated(PlanOptions, {k: v for k, v in pinned.items() if k != FINETUNE})  # one line for a bad pinned value
    finetune_options(pinned.get(FINETUNE))
    gpu = get_gpu(args.gpu)
    network = build_network(args, gpu)
    calibration = calibration_for(args.calibration, gpu.name)
    model = load_model_spec(args.model)
    backends = _backends(args.backends, pinned.pop("backend", None))
    result = search(model, args.gpus, gpu, network, backends, calibration=calibration, **pinned)
    refusal = result.refusal() and _pinned_refusal(model, args.gpus, backends, pinned, result.refusal())
    if refusal is not None:  # a mistyped option (--ep 3 for 8 experts), not an empty table
        raise refusal
    ranked = result.ranked
    if args.train_tokens is not None:  # the wall-clock days with checkpoints and failures rank the plans

        ranked = rank_by_training_days(model, ranked, gpu, args.train_tokens, failure_inputs(args))
    top = ranked[: args.top]
    plans = [plan_record(model, c.plan, c.memory, c.time, gpu, calibration) for c in top]
    add_training_time(plans, args)
    record = RankedPlans(plans=plans, rejected=dict(result.rejected.most_common()), considered=result.considered,
                         calibration=None if calibration is None else calibration.describe())
    return PlanOutcome(record, model, gpu, top, network, tuple(backends))


@dataclass(frozen=True)
class LongestPlans:
    """What `dmt plan --max-seq-len --json` prints: the plans at their longest sequence, longest first."""

    plans: list[dict]  # label, plan, step_time_s, max_seq_len, limit
    considered: int
    fitting: int

    def as_json(self) -> dict:
        return dict(plans=self.plans, considered=self.considered, fitting=self.fitting)


def result(args: argparse.Namespace) -> RankedPlans | LongestPlans:
    """What `dmt plan --json` prints (and `dmt explore` answers); with --max-seq-len, the longest-sequence ranking."""
    if args.max_seq_len:
        return longest_results(args)
    return plan_results(args).record


def longest_results(args: argparse.Namespace) -> LongestPlans:
    """`dmt plan --max-seq-len`: the plans at their longest sequence, longest first, then fastest there."""
    check_max_seq_len(args)
    if args.top < 1:
        raise UserInputError("--top", f"must be at least 1, got {args.top}")
    pinned = plan_overrides(args)
    if pinned.get(FINETUNE):
        raise UserInputError("--max-seq-len", "searches full training plans; leave out the fine-tuning flags")
    validated(PlanOptions, pinned)
    gpu = plan_gpu(args)
    network = build_network(args, gpu)
    calibration = calibration_for(args.calibration, gpu.name)
    model = load_model_spec(args.model)
    backends = _backends(args.backends, pinned.pop("backend", None))
    found, considered = longest_plans(model, args.gpus, gpu, network, backends, calibration, **pinned)
    plans = [dict(label=plan_label(c.longest.plan), plan=c.longest.plan.as_dict(), step_time_s=c.step_time_s,
                  **c.longest.as_json()) for c in found[: args.top]]
    return LongestPlans(plans, considered, len(found))


def run(args: argparse.Namespace) -> int:
    if args.max_seq_len:
        record = longest_results(args)
        if args.json:
            print(json_text(record.as_json(), indent=2))
        else:
            for rank, p in enumerate(record.plans, 1):
                print(f"{rank:>3}  {p['max_seq_len']:>12,}  {p['step_time_s']:>9.3g} s  {p['label']}  "
                      f"(next: {p['limit']['component']})")
            print(f"{record.considered} plans considered, {record.fitting} fit at 1024 tokens or more; "
                  f"ranked by their longest sequence, then their step time there")
        return 0 if record.plans else 1
    if args.seq_len is None:
        raise UserInputError("--seq-len", "is required (or --max-seq-len, to search for the longest)")

    if args.plot is not None:  # before the search: a plot that cannot be written is refused at once

        args.plot = output_file(args.plot, "--plot", suffix=".png")
    outcome = plan_results(args)
    if args.plot is not None:
        _plot(args, outcome)
    plans = outcome.record.plans
    if args.json:
        print(json_text(outcome.record.as_json(), indent=2))
        return 0 if plans else 1
    _print_table(outcome.model, args, outcome.gpu, outcome.record)
    if len(outcome.top) >= 2:
        if args.train_tokens is not None:
            print(f"winner: {_fewer_days(*plans[:2])}")
        else:
            print(f"winner: {why_first_beats_second(outcome.top[0], outcome.top[1])}")
    if args.explain and outcome.model.is_moe:  # why a backend's plans keep every expert on every rank
        for name in outcome.backends:
            if (why := backend_of(name).rules.EP_REFUSAL) is not None:
                print(f"{name}: no expert parallelism searched: {why}")
    if args.explain and outcome.top:
        line = against_tuned(outcome.model, outcome.top[0].plan, outcome.top[0].time, outcome.gpu, outcome.network)
        print(line or "no tuned published layout of this model, cluster and batch to compare with "
                      "(toolkit/planner/tuned_layouts.py)")
    if args.plot is not None:
        print(f"memory plot written to {args.plot}")
    return 0 if plans else 1


def _fewer_days(first, second) -> str:
    """Why the first plan ranks first by wall-clock days with checkpoints and failures."""
    a, b = first.training_time, second.training_time
    saved = (b.days - a.days) / b.days * 100 if b.days else 0.0
    step = (second.step_time_s - first.step_time_s) / second.step_time_s * 100
    return (f"{saved:.2f}% fewer days with failures than the runner-up ({a.days:,.2f} against {b.days:,.2f}): step "
            f"{abs(step):.1f}% {'faster' if step >= 0 else 'slower'}, goodput {a.goodput:.1%} against {b.goodput:.1%} "
            f"(checkpoint blocking {a.checkpoint.blocking_s:.3g} s against {b.checkpoint.blocking_s:.3g} s)")


def _plot(args: argparse.Namespace, outcome: PlanOutcome) -> None:
    """The memory of the top plans beside ZeRO 0-3 of the same model (--plot)."""
    model = outcome.model
    zero_plans = []
    for stage in range(4):
        try:
            plan = resolve_plan(model, args.gpus, zero=stage, seq_len=args.seq_len, global_batch=args.global_batch,
                                finetune=plan_overrides(args).get(FINETUNE), gpus_per_node=args.gpus_per_node,
                                precision=args.precision, recompute="full")
        except UserInputError:
            continue
        zero_plans.append((plan, estimate_memory(model, plan)))
    write_memory_plot(args.plot, model, outcome.gpu, [(c.plan, c.memory) for c in outcome.top[:6]], zero_plans)


def _pinned_refusal(model, gpus: int, backends: tuple[str, ...], pinned: dict, found: UserInputError):
    """Why no layout was left: resolving the pinned options alone, backend by backend, names the flag (the search
    skips layouts the GPU count cannot hold without asking); else the search's own most frequent reason."""
    for backend in backends:
        try:
            resolve_plan(model, gpus, **{**pinned, "backend": backend})
        except UserInputError as exc:
            return exc
    return found


def _backends(listed: str | None, pinned: str | None) -> tuple[str, ...]:
    """The backends to search: --backends (a comma list), or the one --backend pins, or all of them."""
    if listed is None:
        return (pinned,) if pinned else NAMES
    names = tuple(dict.fromkeys(name.strip() for name in listed.split(",") if name.strip()))
    unknown = [name for name in names if name not in NAMES]
    if unknown or not names:
        raise UserInputError("--backends", f"got {listed!r}; valid: a comma list of {', '.join(NAMES)}")
    if pinned and pinned not in names:
        raise UserInputError("--backend", f"{pinned} is not among --backends {','.join(names)}")
    return (pinned,) if pinned else names


def _print_table(model, args, gpu, record: RankedPlans) -> None:
    from rich.table import Table

    console = make_console()
    console.print(f"[bold]{model.name}[/] on {args.gpus} x {gpu.name}, seq {args.seq_len}, global batch {args.global_batch}: "
                  f"{record.considered} plans considered, {record.considered - sum(record.rejected.values())} fit")
    table = Table()
    timed = args.train_tokens is not None
    timed_columns = ("days w/o failures", "days", "GPU-h", "goodput", "ckpt every", "interruptions")
    for col in ("#", "plan", "GiB/GPU", "step s", "tokens/s", "TFLOP/s/GPU", "MFU") + (timed_columns if timed else ()):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for rank, r in enumerate(record.plans, 1):
        table.add_row(str(rank), plan_label(r.plan), f"{r.memory_bytes.total / GiB:.1f}",
                      f"{r.step_time_s:.3g}", f"{r.tokens_per_s:,.0f}", f"{r.tflops_per_gpu:.0f}", f"{r.mfu:.1%}",
                      *(_timed_cells(r.training_time) if timed else ()))
    console.print(table)
    rejected = ", ".join(f"{n} {why}" for why, n in record.rejected.items()) or "none"
    if timed:
        console.print("ranked by days with checkpoints and failures (Daly's optimum interval; see dmt estimate "
                      "--train-tokens for the inputs)")
    console.print(f"rejected: {rejected}")
    console.print(f"MFU = {MFU_NOTE}")
    console.print(calibration_line(record.calibration))


def _timed_cells(t) -> tuple[str, ...]:
    return (f"{t.days_compute:,.1f}", f"{t.days:,.1f}", f"{t.gpu_hours:,.0f}", f"{t.goodput:.1%}",
            f"{t.checkpoint.interval_steps:,} steps", f"{t.interruptions:,.1f}")
