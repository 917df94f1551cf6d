"""`dmt restore-test`: train, kill after a save, resume, and demand the same run (bitwise on CPU)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from toolkit.backends.megatron.checkpoint import expert_resharding_problem
from toolkit.checkpoint.restore import LAUNCHERS, WORKDIR_ENTRIES, restore_test
from toolkit.cli.options import add_plan_flags, option_argv, plan_overrides
from toolkit.cli.paths import output_arg, path_arg
from toolkit.data.blend import check_blend
from toolkit.errors import UserInputError
from toolkit.numeric import bounded_int, finite_float, json_text
from toolkit.outputs import output_directory, removed_if_interrupted
from toolkit.planner.recipe import recipe_plan
from toolkit.spec.backends import backend_of
from toolkit.spec.recipe import (
    load_recipe,
    recipe_at_world_size,
    recipe_files,
    recipe_model,
    recipe_names,
    recipe_vocab_size,
)

RESHARDED_TOLERANCE = 1e-3  # loss, grad norm and lr after resharding: only the order of the sums differs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", type=path_arg, required=True)
    parser.add_argument("--steps", type=bounded_int, default=None, help="steps of every run (default: the recipe's max_steps)")
    parser.add_argument("--save-at", type=bounded_int, default=None, help="step to save at and kill after (default: steps / 2)")
    parser.add_argument("--resume-world-size", type=bounded_int, default=None,
                        help="processes of the resumed run (DeepSpeed: through a universal checkpoint; Megatron-Core "
                             "and FSDP2: the DCP checkpoint reshards on load)")
    parser.add_argument("--resume-ep", type=bounded_int, default=None,
                        help="expert-parallel size of the resumed run (Megatron-Core: its dist checkpoint reshards "
                             "the experts on load)")
    parser.add_argument("--launcher", choices=tuple(LAUNCHERS), default=None,
                        help="launcher of the deepspeed backend (default deepspeed; megatron and fsdp run under "
                             "torchrun)")
    parser.add_argument("--tolerance", type=finite_float, default=None,
                        help=f"allowed |difference| per value (default: bitwise; {RESHARDED_TOLERANCE:g} with "
                             f"--resume-world-size, where the reduction order changes)")
    parser.add_argument("--workdir", type=output_arg, default=None,
                        help="where the three runs go (default: a new temp dir)")
    parser.add_argument("--timeout", type=finite_float, default=900, help="seconds per launch")
    parser.add_argument("--json", action="store_true")
    add_plan_flags(parser, overriding="the recipe's plan in every run")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--resume-world-size", args.resume_world_size), ("--resume-ep", args.resume_ep),
                        ("--timeout", args.timeout)):
        if value is not None and value <= 0:
            raise UserInputError(flag, f"must be positive, got {value}")
    if args.tolerance is not None and args.tolerance < 0:
        raise UserInputError("--tolerance", f"must be 0 (bitwise) or more, got {args.tolerance}")
    recipe = load_recipe(args.recipe)
    workdir = None
    if args.workdir is not None:  # checked before anything runs; an existing directory must hold no earlier runs

        workdir = output_directory(args.workdir, "--workdir", inputs=recipe_files(recipe), names=WORKDIR_ENTRIES)
    steps = recipe.training.max_steps if args.steps is None else args.steps
    if steps < 2:
        raise UserInputError("--steps", f"must be at least 2 (a save, then a step to compare), got {steps}")
    save_at = steps // 2 if args.save_at is None else args.save_at
    if not 0 < save_at < steps:
        raise UserInputError("--save-at", f"must be between 1 and --steps - 1 = {steps - 1}, got {save_at}")
    overrides = plan_overrides(args)
    # the plan every launch will train, resolved here: a bad one is one line now, not a worker's log later
    with recipe_names(overrides):
        plan = recipe_plan(recipe, recipe_model(recipe), **overrides)
    if recipe.data.blend:  # the blend's files, tokenizer and token ids: one line now, not a rank's log later

        check_blend(recipe, recipe_vocab_size(recipe))
    warmup = recipe.training.warmup_steps
    backend_of(plan).rules.check_steps(steps, warmup, "--steps")
    launcher = _launcher(args.launcher, plan.backend)
    train_args = tuple(option_argv({"backend": plan.backend, **overrides}))
    resume_args = ()
    if args.resume_ep not in (None, plan.ep):
        if (why := backend_of(plan).rules.EP_REFUSAL) is not None:
            raise UserInputError("--resume-ep", f"the {plan.backend} backend trains no expert parallelism: {why}")
        problem = expert_resharding_problem(plan.ep, args.resume_ep)
        if problem:
            raise UserInputError("--resume-ep", problem)
        with recipe_names(overrides):  # the resumed run's plan, resolved now: a bad one is one line here
            recipe_plan(recipe, recipe_model(recipe), **{**overrides, "ep": args.resume_ep})
        resume_args = ("--ep", str(args.resume_ep))
    if args.resume_world_size not in (None, recipe.cluster.gpus):  # the resumed run's plan too: one line now, not
        resized = recipe_at_world_size(recipe, args.resume_world_size)  # after the reference run and the killed one
        try:
            resumed = {**overrides, **({"ep": args.resume_ep} if resume_args else {})}
            with recipe_names(resumed):
                recipe_plan(resized, recipe_model(resized), **resumed)
        except UserInputError as exc:
            raise UserInputError("--resume-world-size", f"{args.resume_world_size} processes cannot resume this "
                                                        f"plan: {exc}") from None
    resharded = args.resume_world_size not in (None, recipe.cluster.gpus) or bool(resume_args)
    tolerance = args.tolerance if args.tolerance is not None else RESHARDED_TOLERANCE if resharded else 0.0
    fresh = workdir is None or not workdir.exists()  # interrupted, a directory this command made goes whole
    scratch = workdir is None  # no --workdir: a temp dir of the command's own, removed if the test passes
    workdir = workdir or Path(tempfile.mkdtemp(prefix="dmt-restore-"))  # after every check: a refusal leaves none
    with removed_if_interrupted(workdir, whole=fresh):
        result = restore_test(args.recipe, workdir, steps, save_at, recipe.cluster.gpus, args.resume_world_size,
                              launcher, tolerance, args.timeout, train_args, resume_args)
    kept = not (scratch and result.passed)  # a failure keeps its runs and logs (an error's line names its log)
    if not kept:
        shutil.rmtree(workdir)
    _report(args, result, recipe, tolerance, resharded, workdir, kept)
    return 0 if result.passed else 1


def _launcher(given: str | None, backend: str) -> str:
    """The launcher of every run: the one given, if the backend runs under it (generate's one list of launchers per
    backend), else the backend's own (torchrun for Megatron-Core and FSDP2, deepspeed for DeepSpeed)."""
    valid = [name for name in backend_of(backend).launchers if name in LAUNCHERS]
    if given is not None and given not in valid:
        raise UserInputError("--launcher", f"the {backend} backend runs under {' or '.join(valid)}, not {given}")
    return given or valid[0]


def _report(args, result, recipe, tolerance: float, resharded: bool, workdir: Path, kept: bool) -> None:
    where = f"runs and logs in {workdir}" if kept else "runs and logs removed (passed; --workdir DIR keeps them)"
    if args.json:
        print(json_text(result.as_dict(), indent=2))
        if not result.passed:  # stdout stays one JSON object
            print(f"dmt restore-test: {where}", file=sys.stderr)
    else:
        verdict = "PASSED" if result.passed else "FAILED"
        kind = "identical to the bit" if result.identical else f"max |loss diff| {result.max_abs_diff:.3g} " \
                                                              f"(tolerance {tolerance:g})"
        if args.resume_world_size not in (None, recipe.cluster.gpus):
            kind += f", resumed on {args.resume_world_size} processes instead of {recipe.cluster.gpus}"
        if args.resume_ep is not None:
            kind += f", resumed at EP {args.resume_ep}"
        print(f"restore-test {verdict}: saved at step {result.save_at}, killed at step {result.killed_at_step}, "
              f"resumed from {result.checkpoint}; steps {result.resumed_at + 1}-{result.steps} {kind}")
        for line in result.mismatches[:10]:
            print(f"  {line}")
        print(where)
