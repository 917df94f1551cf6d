"""A directory `dmt generate` wrote, checked before training runs it: the recipe is the one it was generated from,
plan.json holds a valid plan that the recipe still gives, and every generated file states that plan.

Training then runs these files as they are (toolkit/train.py --plan DIR/plan.json): a hand edit the files allow, a
DeepSpeed key the plan does not own say, is honoured; one that changes the plan stops training with one line naming
the file and the key.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.generate.files import PLAN_FILE, recipe_settings
from toolkit.generate.ft_launcher import FILE as FT_FILE
from toolkit.generate.ft_launcher import SECTION as FT_SECTION
from toolkit.generate.trainer_args import trainer_arguments
from toolkit.planner.recipe import recipe_options, recipe_plan
from toolkit.readers import read_json, read_yaml
from toolkit.spec.backends import backend_of
from toolkit.spec.lr_scaling import lr_schedule, scaled_training
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan, check_sequence_split, finetune_options, validated
from toolkit.spec.recipe import Recipe, load_recipe, recipe_model
from toolkit.validate.accelerate_fsdp import accelerate_plan_view
from toolkit.validate.deepspeed import deepspeed_plan_view, finetune_problems
from toolkit.validate.megatron import megatron_plan_view, validate_megatron_config
from toolkit.validate.trainer_args import trainer_defaults, trainer_plan_view


@dataclass(frozen=True)
class GeneratedRun:
    """What training runs: the recipe, the plan of plan.json and the generated files' contents (as on disk)."""

    directory: Path
    recipe: Recipe
    model: ModelSpec
    plan: Plan
    deepspeed: dict | None = None  # deepspeed.json
    trainer_args: dict | None = None  # trainer_args.json
    megatron: dict | None = None  # megatron.yaml
    accelerate: dict | None = None  # accelerate.yaml of an fsdp plan (its launcher reads it; checked here)
    prediction: dict | None = None  # plan.json's record: the plan with its predicted memory, step time, tokens/s, MFU


def _flatten(data, prefix: str = "") -> dict:
    if isinstance(data, dict):
        flat = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): data}


def _first_difference(recorded: dict, current: dict) -> tuple[str, object, object] | None:
    then, now = _flatten(recorded), _flatten(current)
    for key in list(now) + [k for k in then if k not in now]:
        if then.get(key, "(absent)") != now.get(key, "(absent)"):
            return key, then.get(key, "(absent)"), now.get(key, "(absent)")
    return None


def _same(a, b) -> bool:
    return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def _check_recipe(record: dict, recipe: Recipe, plan_path: Path) -> None:
    difference = _first_difference(record.get("recipe_settings") or {}, recipe_settings(recipe))
    if difference:
        key, then, now = difference
        raise UserInputError(str(plan_path), f"the recipe changed since `dmt generate` wrote it ({key}: {then!r} -> "
                                             f"{now!r}); run `dmt generate` again")


def _check_plan_against_recipe(plan: Plan, recipe: Recipe, model: ModelSpec, record: dict, plan_path: Path) -> None:
    """Every option the recipe (and the overrides `dmt generate` was given) fixes must be the plan's; with an
    explicit plan, the whole resolved plan must be."""
    overrides = record.get("overrides") or {}
    if recipe.plan.auto:
        expected = {k: v for k, v in recipe_options(recipe, **overrides).items() if v is not None}
        expected["gpus"] = recipe.cluster.gpus
        expected["finetune"] = finetune_options(expected["finetune"]).model_dump(mode="json")
    else:
        expected = recipe_plan(recipe, model, **overrides).as_dict()
    stated = plan.as_dict()
    for name, value in expected.items():
        if name in stated and not _same(stated[name], value):
            raise UserInputError(str(plan_path), f"plan.{name} is {stated[name]!r} but the recipe gives {value!r}; "
                                                 f"run `dmt generate` again (or change the recipe)")


def _check_view(path: Path, view: dict, plan: Plan) -> None:
    stated = plan.as_dict()
    for name, (key, value) in view.items():
        if name in stated and not _same(stated[name], value):
            raise UserInputError(str(path), f"{key} is {value!r} but plan.json says {name} {stated[name]!r}; run "
                                            f"`dmt generate` again, or edit only what the plan does not set")


def read_generated(plan_path: Path, recipe_path: Path | None = None) -> GeneratedRun:
    """Read and check a generated directory through its plan.json; one UserInputError line on the first problem."""
    plan_path = Path(plan_path)
    if plan_path.is_dir():
        plan_path = plan_path / PLAN_FILE
    record = read_json(plan_path, "--plan", what="the plan.json `dmt generate` writes")
    if not isinstance(record.get("plan"), dict) or not isinstance(record.get("files"), list):
        raise UserInputError("--plan", f"{plan_path} is not a plan.json written by `dmt generate` (no plan/files)")
    recipe_file = recipe_path or record.get("recipe_path")
    if not recipe_file:
        raise UserInputError("--recipe", f"{plan_path} names no recipe; pass --recipe")
    recipe = load_recipe(recipe_file)
    _check_recipe(record, recipe, plan_path)
    model = recipe_model(recipe)
    try:
        plan = validated(Plan, record["plan"], context={"model": model})
    except UserInputError as exc:
        raise UserInputError(f"{plan_path}: plan", f"{exc.key}: {exc.message}") from None
    _check_plan_against_recipe(plan, recipe, model, record, plan_path)
    check_sequence_split(plan, model)  # DeepSpeed's Ulysses refuses these heads only once the model is built
    directory = plan_path.parent
    contents: dict = {}
    readers = backend_of(plan).validate.READERS  # the generated files its training reads
    for name in record["files"]:
        if name in readers:
            field, read = readers[name]
            contents[field] = read(directory / name, plan)
    _check_learning_rate(plan_path, record, recipe, contents)
    if FT_FILE in record["files"]:  # launch.sh ft_launcher reads it (generated directories before it have none)
        read_ft_config(directory / FT_FILE)
    if contents.get("trainer_args") is not None:
        _check_outward(directory / "trainer_args.json", contents["trainer_args"], recipe, plan)
    if "accelerate" in contents:  # with the trainer arguments it must agree with
        _check_accelerate(directory / "accelerate.yaml", contents["accelerate"], contents.get("trainer_args"), plan)
    return GeneratedRun(directory, recipe, model, plan, **contents, prediction=record)


def _check_learning_rate(plan_path: Path, record: dict, recipe: Recipe, contents: dict) -> None:
    """plan.json's lr_scaling is what the recipe's rule gives now, and every generated file trains at its rate."""
    expected = lr_schedule(recipe.training)
    if record.get("lr_scaling") != expected:
        raise UserInputError(f"{plan_path}: lr_scaling", f"{record.get('lr_scaling')} but the recipe's "
                                                         f"training.lr_scaling gives {expected}: regenerate")
    scaled = scaled_training(recipe.training)
    rate = scaled.learning_rate
    trainer, deepspeed, megatron = (contents.get(k) or {} for k in ("trainer_args", "deepspeed", "megatron"))
    ds_scheduler = (deepspeed.get("scheduler") or {}).get("params") or {}
    mg_scheduler = megatron.get("scheduler") or {}
    found = {"trainer_args.json learning_rate": trainer.get("learning_rate"),
             "DeepSpeed config optimizer.params.lr": ((deepspeed.get("optimizer") or {}).get("params") or {}).get("lr"),
             "DeepSpeed config scheduler.params.warmup_max_lr": ds_scheduler.get("warmup_max_lr"),
             "megatron.yaml optimizer_config.lr": (megatron.get("optimizer_config") or {}).get("lr"),
             "megatron.yaml scheduler.max_lr": mg_scheduler.get("max_lr"),
             "megatron_args.txt --lr": _argument(plan_path.parent, record, "--lr", float)}
    for where, value in found.items():
        if isinstance(value, (int, float)) and not math.isclose(value, rate, rel_tol=1e-6):  # "auto": HF fills it
            raise UserInputError(f"{plan_path.parent}: {where}", f"{value} but the plan trains at {rate:g} "
                                                                 f"(training.learning_rate{' scaled' if expected else ''}): "
                                                                 f"regenerate")
    if not (expected and expected["recipe_warmup_steps"]):  # no warm-up: each writer's own minimum stands
        return
    found = {"trainer_args.json warmup_steps": trainer.get("warmup_steps"),
             "DeepSpeed config scheduler.params.warmup_num_steps": ds_scheduler.get("warmup_num_steps"),
             "megatron.yaml scheduler.lr_warmup_steps": mg_scheduler.get("lr_warmup_steps"),
             "megatron_args.txt --lr-warmup-iters": _argument(plan_path.parent, record, "--lr-warmup-iters", int)}
    for where, value in found.items():
        if isinstance(value, int) and value != expected["warmup_steps"]:
            raise UserInputError(f"{plan_path.parent}: {where}", f"{value} but plan.json's lr_scaling warms up over "
                                                                 f"{expected['warmup_steps']} steps (training.warmup_steps "
                                                                 f"{expected['recipe_warmup_steps']} scaled): regenerate")


MEGATRON_ARGS = "megatron_args.txt"  # the Megatron-LM flags `dmt generate` writes beside megatron.yaml (spec/backends.py)


def _argument(directory: Path, record: dict, flag: str, kind):
    """A flag's value in the generated megatron_args.txt (Megatron-LM's own command line, one `--flag value` a line);
    None where the directory has no such file or flag, or the value is not a number."""
    if MEGATRON_ARGS not in record.get("files", []) or not (directory / MEGATRON_ARGS).is_file():
        return None
    for line in (directory / MEGATRON_ARGS).read_text().splitlines():
        name, _, value = line.strip().partition(" ")
        if name == flag:
            try:
                return kind(value.strip())
            except ValueError:
                return None
    return None


# TrainingArguments that send the model or the metrics elsewhere: training honours them only as `dmt generate` wrote
# them from the recipe (training.report_to; no hub), so that a hand edit cannot publish the weights or report to a
# service the recipe does not name
OUTWARD_KEYS = ("push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo", "hub_token", "report_to")


def _reporters(value) -> list:
    """report_to as a sorted list without "none" ("none", [], ["none"] are one thing to HF)."""
    values = [value] if isinstance(value, str) or value is None else list(value) if isinstance(value, list) else [value]
    return sorted((v for v in values if v not in (None, "none")), key=str)


def _check_outward(path: Path, args: dict, recipe, plan: Plan) -> None:
    expected, defaults = trainer_arguments(recipe, plan, "", None), trainer_defaults()
    for key in OUTWARD_KEYS:
        want, got = expected.get(key, defaults.get(key)), args.get(key, defaults.get(key))
        if key == "report_to":
            want, got = _reporters(want), _reporters(got)
        if got != want:
            shown = str(got)[:80]
            raise UserInputError(str(path), f"{key} is {shown}, not {want!r} as `dmt generate` wrote it from the "
                                            f"recipe; what a run sends elsewhere is the recipe's to say "
                                            f"(training.report_to; no hub upload): regenerate")


def read_deepspeed_json(path: Path, plan: Plan) -> dict:
    config = read_json(path, what="the DeepSpeed config `dmt generate` writes")
    _check_view(path, deepspeed_plan_view(config), plan)
    for problem in finetune_problems(config, plan.finetune.method):
        raise UserInputError(str(path), str(problem))
    return config


def read_trainer_args(path: Path, plan: Plan) -> dict:
    args = read_json(path, what="the TrainingArguments `dmt generate` writes")
    _check_view(path, trainer_plan_view(args), plan)
    return args


def read_megatron_yaml(path: Path, plan: Plan) -> dict:
    config = read_yaml(path, what="the megatron.yaml `dmt generate` writes")
    _check_megatron_sections(path, config)
    _check_view(path, megatron_plan_view(config), plan)
    return config


def read_ft_config(path: Path) -> dict:
    """ft_config.yaml, read by NVRx's own FaultToleranceConfig as ft_launcher will (--ft-cfg-path): every key one it
    knows, the signal and log level ones it accepts, the timeouts positive or null (no timeout)."""
    from nvidia_resiliency_ext.fault_tolerance import FaultToleranceConfig  # lazy: nvidia_resiliency_ext

    data = read_yaml(path, what="the ft_config.yaml `dmt generate` writes")
    section = data.get(FT_SECTION) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise UserInputError(str(path), f"no '{FT_SECTION}' mapping (NVRx's FaultToleranceConfig reads that section)")
    try:
        FaultToleranceConfig.from_kwargs(ignore_not_recognized=False, **section)
        config = FaultToleranceConfig.from_args(argparse.Namespace(ft_cfg_path=str(path)))  # as ft_launcher reads it
    except (ValueError, TypeError, KeyError) as exc:
        raise UserInputError(f"{path}: {FT_SECTION}", f"NVRx's FaultToleranceConfig refuses it: {exc}") from None
    for key in ("workload_check_interval", "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
                "rank_out_of_section_timeout", "safety_factor"):
        value = getattr(config, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise UserInputError(f"{path}: {FT_SECTION}.{key}", f"must be a positive number of seconds or null, got "
                                                               f"{value!r}")
    return section


def read_accelerate_yaml(path: Path, plan: Plan) -> dict:
    """Read only: checked against the trainer arguments once both are read (_check_accelerate)."""
    return read_yaml(path, what="the accelerate.yaml `dmt generate` writes")


def _check_accelerate(path: Path, config: dict, trainer: dict | None, plan: Plan) -> None:
    problems = backend_of(plan).validate.accelerate_launch(config, plan.gpus, trainer)
    if problems:
        raise UserInputError(str(path), str(problems[0]))
    _check_view(path, accelerate_plan_view(config), plan)


def _check_megatron_sections(path: Path, config: dict) -> None:
    problems = validate_megatron_config(config)
    if problems:
        raise UserInputError(str(path), str(problems[0]))
