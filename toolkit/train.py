"""The launchable training entry: `deepspeed|accelerate launch|torchrun toolkit/train.py --plan DIR/plan.json` trains
the files `dmt generate` wrote into DIR (and refuses when they no longer match the recipe); `--recipe R` alone
resolves the plan from the recipe in memory, with the same generators (a launch without --plan)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from toolkit.backends.context import TrainContext
from toolkit.cli.main import quiet_library_warnings
from toolkit.cli.options import add_plan_flags, plan_overrides
from toolkit.cli.paths import output_arg, path_arg
from toolkit.errors import UserInputError, error_line
from toolkit.health.checks import match_gpu
from toolkit.planner.recipe import recipe_plan, recipe_prediction
from toolkit.planner.save_interval import is_auto, run_save_steps
from toolkit.runtime import inprocess
from toolkit.runtime.guard import GuardStop
from toolkit.runtime.incident import (
    flight_recorder_environment,
    gloo_flight_recorder_environment,
    last_words_dir,
)
from toolkit.runtime.metrics import (
    Throughput,
    end_run_record,
    run_throughput,
    start_run_record,
    trains_on_cuda,
)
from toolkit.runtime.profile import parse_step_range
from toolkit.runtime.supervision import TrainingWatchdog
from toolkit.runtime.watchdog import exit_now
from toolkit.spec.backends import backend_of
from toolkit.spec.cluster import load_catalogue
from toolkit.spec.lr_scaling import lr_schedule
from toolkit.spec.options import CPU_ATTENTION
from toolkit.spec.quantization import refuse_on_cpu
from toolkit.spec.recipe import (
    load_recipe,
    recipe_at_world_size,
    recipe_calibration,
    recipe_model,
    recipe_names,
)
from toolkit.spec.recipe_training import ProfileSection
from toolkit.validate.generated import GeneratedRun, read_generated


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, as every other refusal of train.py (the launched runs' logs end with it, and the
    commands that launch it report that line: toolkit.errors.worker_error), not the whole usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"train.py: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="toolkit/train.py", description=__doc__, allow_abbrev=False)  # whole option names only
    parser.add_argument("--plan", type=path_arg, default=None, metavar="DIR/plan.json",
                        help="train the plan `dmt generate` wrote, with the generated files beside plan.json")
    parser.add_argument("--recipe", type=path_arg, default=None,
                        help="the recipe (with --plan: default the one plan.json names, and it must be unchanged)")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed JSON for a launch without --plan (default: "
                                                          "generated from the recipe's plan)")
    parser.add_argument("--output-dir", type=output_arg, default=None, help="default: runs/<recipe name>")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps (overrides the recipe)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="latest|auto|PATH",
                        help="resume from the latest verified checkpoint of --output-dir (auto: if there is one), or PATH")
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes of this launch, overriding cluster.gpus (e.g. resuming at another world size)")
    parser.add_argument("--profile-steps", default=None, metavar="A-B",
                        help="record steps A to B with torch.profiler on every rank (the recipe's training.profile "
                             "with these steps): traces and the measured breakdown in OUTPUT/profile/")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_plan_flags(parser, overriding="the recipe's plan")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 trained, 1 a failure (incident.json says which rank), 2 bad input, 3 a hang the watchdog ended,
    4 stopped by the NaN/spike guard."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    quiet_library_warnings()
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except UserInputError as exc:
        print(error_line("train.py", exc), file=sys.stderr)
        return 2
    except GuardStop as exc:
        print(f"train.py: stopped by the guard: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        _destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    for flag, value in (("--max-steps", args.max_steps), ("--save-steps", args.save_steps), ("--gpus", args.gpus)):
        if value is not None and value < 1:
            raise UserInputError(flag, f"must be positive, got {value}")
    run = _generated(args) if args.plan is not None else _quick(args)
    updates = {k: v for k, v in (("max_steps", args.max_steps), ("save_steps", args.save_steps)) if v is not None}
    if "save_steps" not in updates and is_auto(run.recipe):  # `save_steps: auto`: the number dmt generate wrote
        updates["save_steps"] = run_save_steps(run.recipe, run.model, run.plan, run.prediction)
    recipe = run.recipe
    # training.lr_scaling: the learning rate and warm-up dmt generate wrote for this global batch (spec/lr_scaling.py)
    updates = {**_scaled_lr(recipe), **updates}
    if updates:  # the schedule, the DeepSpeed config and the trainer arguments must all see the new values
        recipe = recipe.model_copy(update={"training": recipe.training.model_copy(update=updates)})
    recipe = _profiled(recipe, args.profile_steps, run.plan.gpus)
    check_attention_device(run.plan, recipe.cluster.accelerator)
    if not trains_on_cuda(recipe.cluster.accelerator):  # a GPU plan launched where CUDA is missing, every backend
        refuse_on_cpu(run.plan.precision)
    output_dir = args.output_dir or Path("runs") / recipe.name
    throughput = _record_launch(run, recipe, output_dir, argv=sys.argv)
    in_process = recipe.training.restart == "in_process"
    # in-process restart: NVRx's rank monitors watch the ranks; the toolkit's watchdog would end the job instead
    watch = _watched(output_dir, 0 if in_process else recipe.training.hang_timeout_s)
    try:
        train = backend_of(run.plan).train.train  # toolkit/backends/<name>/train.py

        def attempt(restarted: bool = False):
            return train(TrainContext(run=run, recipe=recipe, output_dir=output_dir,
                                      resume="auto" if restarted else args.resume, deepspeed_json=args.deepspeed,
                                      updates=updates, throughput=throughput, watch=watch))

        if in_process:
            summary = inprocess.run(attempt, output_dir, run.plan.gpus, recipe.training.max_restarts,
                                    recipe.training.hang_timeout_s, _process_group_backend(recipe.cluster.accelerator))
        else:
            summary = attempt()
    except BaseException as exc:
        watch.shield()  # first: a SIGTERM from here on would replace this failure and skip its report
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

        def ended() -> None:  # rank 0's run_plan.json says how the launch ended
            _record_end(output_dir, "failed", detail)

        # the watchdog reports first and ends this process (the launcher's SIGTERM may already be on its way)
        if isinstance(exc, UserInputError):  # on one rank while the others may already wait for it in a collective
            watch.fail(exc, code=2, line=error_line("train.py", exc), before_exit=ended)
        elif isinstance(exc, Exception) and not isinstance(exc, GuardStop):  # the guard stops every rank at once
            watch.fail(exc, before_exit=ended)
        ended()  # no watchdog (one process), a guard stop or an interrupt
        raise
    finally:
        watch.finish()
    _record_end(output_dir, "completed")
    logging.getLogger("toolkit.train").info("done: %s", summary)
    return 0


def _scaled_lr(recipe) -> dict:
    schedule = lr_schedule(recipe.training)
    if schedule is None:
        return {}
    # no warm-up stays none: the writers' own minimum (DeepSpeed's one step) is theirs to apply
    return {"learning_rate": schedule["learning_rate"],
            **({"warmup_steps": schedule["warmup_steps"]} if schedule["recipe_warmup_steps"] else {})}
def _profiled(recipe, steps: str | None, world: int):
    """The recipe with --profile-steps A-B as its training.profile (its ranks and memory kept), checked against the
    launch: steps within max_steps, ranks within the world."""
    profile = recipe.training.profile
    if steps is not None:
        try:
            first, last = parse_step_range(steps)
        except ValueError as exc:
            raise UserInputError("--profile-steps", str(exc)) from None
        kept = profile.model_dump(include={"ranks", "memory"}) if profile is not None else {}
        profile = ProfileSection(start_step=first, steps=last - first + 1, **kept)
        recipe = recipe.model_copy(update={"training": recipe.training.model_copy(update={"profile": profile})})
    if profile is None:
        return recipe
    key = "--profile-steps" if steps is not None else "training.profile.start_step"
    if profile.last_step > recipe.training.max_steps:
        raise UserInputError(key, f"steps {profile.start_step}-{profile.last_step} end past the run's "
                                  f"{recipe.training.max_steps} steps; valid: within 1-{recipe.training.max_steps}")
    outside = [rank for rank in profile.ranks or () if rank >= world]
    if outside:
        raise UserInputError("training.profile.ranks", f"rank {outside[0]} is not in this launch of {world} "
                                                       f"processes; valid: 0-{world - 1}")
    return recipe


def check_attention_device(plan, accelerator: str) -> None:
    """flash-attn is a CUDA extension: ranks that train on the CPU (a CPU recipe, or CUDA missing) refuse a CUDA-only
    plan.attention before anything is built, as does a GPU host without the flash-attn package."""
    import importlib.util

    if plan.attention in CPU_ATTENTION:
        return
    if not trains_on_cuda(accelerator):
        raise UserInputError("plan.attention", f"{plan.attention} needs CUDA (flash-attn is a CUDA extension) and "
                                               f"these ranks train on the CPU; valid on CPU ranks: "
                                               f"{', '.join(CPU_ATTENTION)}")
    if importlib.util.find_spec("flash_attn") is None:
        raise UserInputError("plan.attention", f"{plan.attention} needs the flash-attn package, which is not "
                                               f"installed here (pip install flash-attn); or use "
                                               f"{' or '.join(CPU_ATTENTION)}")


def _process_group_backend(accelerator: str) -> str:
    return "nccl" if trains_on_cuda(accelerator) else "gloo"


def _rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _record_launch(run, recipe, output_dir: Path, argv: list[str]):
    """Rank 0 keeps the prediction this launch trains against in the run directory (run_plan.json: plan.json's record
    with `--plan`, else the same prediction made now); every rank gets what turns its step times into tokens/s and
    MFU (the peak only where the device is the one predicted for, and only on rank 0, which writes metrics)."""
    if not _rank_zero():
        return Throughput(run.plan.global_batch * run.plan.seq_len)
    prediction = run.prediction
    if prediction is None:
        prediction = recipe_prediction(recipe, run.model, run.plan, recipe_calibration(recipe)).as_json()
    prediction = {"model_spec": run.model.model_dump(mode="json"), **prediction}  # a plan.json of an older toolkit
    start_run_record(output_dir, prediction, {
        "argv": argv, "plan_json": str(run.directory / "plan.json") if run.prediction is not None else None,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")), "accelerator": recipe.cluster.accelerator,
        **_device(recipe.cluster.accelerator), "max_steps": recipe.training.max_steps,
        "threads_per_rank": _threads()})
    return run_throughput(run.model, run.plan, prediction, recipe.cluster.accelerator)


def _device(accelerator: str) -> dict:
    """The device rank 0 trains on, for run_plan.json: torch's name for it ("cpu" for CPU ranks) and the catalogue
    entry it is (None: a GPU the catalogue does not know), so a calibration is filed under the hardware used."""
    import torch

    if not trains_on_cuda(accelerator):
        return {"device": "cpu", "device_gpu": "cpu"}
    name = torch.cuda.get_device_name(int(os.environ.get("LOCAL_RANK", "0")))
    return {"device": name, "device_gpu": match_gpu(name, {k: gpu.name for k, gpu in load_catalogue().items()})}


def _threads() -> int:
    """The threads this rank's torch computes with (a CPU rank's share of the host: `dmt calibrate` measures the host
    peak at the runs' ranks x this)."""
    import torch

    return torch.get_num_threads()


def _record_end(output_dir: Path, status: str, detail: str | None = None) -> None:
    if _rank_zero():
        end_run_record(output_dir, status, detail)


def _watched(output_dir: Path, hang_timeout_s: float):
    """This rank's training watchdog; torch's flight recorder on (NCCL's on GPUs, the backend-neutral one gloo records
    into), unless the environment says otherwise, so that a hang's report names the collective from each rank's record
    of its last collectives."""
    import torch

    if torch.cuda.is_available():
        for name, value in flight_recorder_environment(output_dir).items():
            os.environ.setdefault(name, value)
        last_words_dir(output_dir).mkdir(parents=True, exist_ok=True)
    for name, value in gloo_flight_recorder_environment().items():  # gloo's collectives too (torch 2.13)
        os.environ.setdefault(name, value)
    return TrainingWatchdog(output_dir, hang_timeout_s)


def _generated(args: argparse.Namespace):
    """The generated directory's plan and files; nothing on the command line may change what they say."""
    given = plan_overrides(args)
    if given:
        name = next(iter(given))
        raise UserInputError(f"--{name.replace('_', '-')}", "the plan comes from plan.json; pass it to `dmt generate` "
                                                            "instead")
    for flag, value in (("--deepspeed", args.deepspeed), ("--gpus", args.gpus)):
        if value is not None:
            raise UserInputError(flag, "the plan comes from plan.json and its files; regenerate instead")
    run = read_generated(args.plan, args.recipe)
    if run.megatron is not None and args.max_steps not in (None, run.megatron["schedule"]["train_iters"]):
        raise UserInputError("--max-steps", f"megatron.yaml trains schedule.train_iters "
                                            f"{run.megatron['schedule']['train_iters']} steps; regenerate to change it")
    return run


def _quick(args: argparse.Namespace):
    """The plan resolved from the recipe, its files made in memory by the generators at launch."""
    if args.recipe is None:
        raise UserInputError("--recipe", "is required without --plan")
    recipe = load_recipe(args.recipe)
    if args.gpus is not None:
        recipe = recipe_at_world_size(recipe, args.gpus)
    with recipe_names(plan_overrides(args)):
        model = recipe_model(recipe)
        plan = recipe_plan(recipe, model, **plan_overrides(args))
    backend = backend_of(plan)
    if args.deepspeed and not backend.hf_modules:
        raise UserInputError("--deepspeed", f"is a DeepSpeed option; the {backend.name} backend builds "
                                            f"{' and '.join(backend.files)}")
    return GeneratedRun(Path("."), recipe, model, plan)


def _destroy_process_group() -> None:
    """gloo can abort at interpreter exit if the group is still alive; end it explicitly."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # best effort at shutdown
        pass


class _EndAfterExitHandlers:
    """Ends a finished launch without the interpreter's teardown. Everything is written and the process group is
    destroyed by then, yet a rank has aborted in that teardown ('terminate called without an active exception', a C++
    thread destroyed while joinable; seen on DeepSpeed ZeRO-3 and FSDP CPU-offload runs on gloo), turning a completed
    job into a failed one that torchrun would restart. Registered before main() runs, `end` is the last exit handler
    the interpreter calls (atexit calls them in reverse order, after it has waited for every non-daemon thread): the
    handlers registered later (wandb's finish, DeepSpeed's shared-memory release) have run, logging's (registered at
    its import, before this one) is called here, and the process ends with main()'s code before the teardown. When
    main() raised instead, nothing is set and the interpreter ends as it always does."""

    def __init__(self):
        self.code: int | None = None

    def end(self) -> None:
        if self.code is None:
            return

        logging.shutdown()
        exit_now(self.code)


if __name__ == "__main__":
    import atexit
    import faulthandler

    faulthandler.enable()  # a rank that crashes in native code leaves its Python stack in the launcher's log
    ending = _EndAfterExitHandlers()
    atexit.register(ending.end)
    ending.code = main()
    sys.exit(ending.code)
