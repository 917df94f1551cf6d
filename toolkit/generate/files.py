"""`dmt generate`: resolve a recipe once and write every launch file from that one plan, atomically.

Writers form a registry (file name -> function of the context). plan.json is the record of the plan: the resolved
Plan with its predicted memory and step time, and what it was made from (the recipe's settings, the command-line
overrides), so that `toolkit/train.py --plan DIR/plan.json` trains exactly these files or refuses when they no longer
match (toolkit/validate/generated.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.numeric import json_text, yaml_text
from toolkit.planner.recipe import recipe_plan, recipe_prediction
from toolkit.spec.calibration import Calibration
from toolkit.spec.model import ModelSpec
from toolkit.spec.options import BACKENDS
from toolkit.spec.plan import Plan
from toolkit.spec.prediction import PlanFile
from toolkit.spec.recipe import Recipe, load_recipe, recipe_calibration, recipe_files, recipe_model, recipe_names


@dataclass(frozen=True)
class GenerationContext:
    recipe: Recipe
    recipe_path: Path
    model: ModelSpec
    plan: Plan
    out_dir: Path
    overrides: dict = field(default_factory=dict)  # plan options given on the command line (plan.json keeps them)
    calibration: Calibration | None = None  # --calibration, else the recipe's cluster.calibration


def _deepspeed(ctx: GenerationContext) -> str:
    from toolkit.generate.deepspeed import deepspeed_config

    return json_text(deepspeed_config(ctx.plan, ctx.recipe.training, ctx.recipe.deepspeed), indent=2) + "\n"


def _accelerate(ctx: GenerationContext) -> str:
    if ctx.plan.backend == "fsdp":
        from toolkit.generate.fsdp import accelerate_fsdp_config, decoder_layer_classes
        from toolkit.spec.recipe import recipe_hf_config

        config = accelerate_fsdp_config(ctx.recipe, ctx.plan, decoder_layer_classes(recipe_hf_config(ctx.recipe)))
        return yaml_text(config, sort_keys=False)
    from toolkit.generate.accelerate import accelerate_config

    return yaml_text(accelerate_config(ctx.recipe, ctx.plan, str(ctx.out_dir / "deepspeed.json")), sort_keys=False)


def _trainer_args(ctx: GenerationContext) -> str:
    from toolkit.generate.trainer_args import trainer_arguments

    deepspeed_json = str(ctx.out_dir / "deepspeed.json") if ctx.plan.backend == "deepspeed" else None
    args = trainer_arguments(ctx.recipe, ctx.plan, str(ctx.out_dir / "run"), deepspeed_json)
    return json_text(args, indent=2) + "\n"


def _launch(ctx: GenerationContext) -> str:
    from toolkit.generate.launch import launch_script

    return launch_script(ctx.recipe, ctx.plan, str(ctx.recipe_path.resolve()))


def _slurm(ctx: GenerationContext) -> str:
    from toolkit.errors import named_as
    from toolkit.generate.slurm import render_sbatch

    with named_as({"--output-dir": "--out"}):  # the job trains into --out/run
        return render_sbatch(ctx.recipe, ctx.plan, ctx.recipe_path, output_dir=str(ctx.out_dir / "run"),
                             train_flags=["--plan", str(ctx.out_dir / PLAN_FILE)])


def _plan(ctx: GenerationContext) -> str:
    record = recipe_prediction(ctx.recipe, ctx.model, ctx.plan, ctx.calibration, PlanFile, recipe=ctx.recipe.name,
                               auto=ctx.recipe.plan.auto, recipe_path=str(ctx.recipe_path.resolve()),
                               recipe_settings=recipe_settings(ctx.recipe), overrides=ctx.overrides,
                               files=[name for name in files_of(ctx.plan.backend) if name != PLAN_FILE])
    return json_text(record.as_json(), indent=2) + "\n"


def recipe_settings(recipe: Recipe) -> dict:
    """What plan.json records of the recipe, to tell later whether the recipe changed since (its location aside)."""
    return recipe.model_dump(mode="json", exclude={"base_dir"})


def _megatron_config(ctx: GenerationContext) -> dict:
    from toolkit.generate.megatron import megatron_config
    from toolkit.spec.recipe import recipe_hf_config

    return megatron_config(ctx.recipe, ctx.model, ctx.plan, recipe_hf_config(ctx.recipe))


def _megatron_yaml(ctx: GenerationContext) -> str:
    from toolkit.generate.megatron import megatron_yaml

    return megatron_yaml(_megatron_config(ctx), ctx.recipe.name)


def _megatron_args(ctx: GenerationContext) -> str:
    from toolkit.generate.megatron_args import megatron_args_text

    return megatron_args_text(_megatron_config(ctx), ctx.recipe.name)


PLAN_FILE = "plan.json"
# file name -> (backends it belongs to, writer)
WRITERS: dict[str, tuple[tuple[str, ...], Callable[[GenerationContext], str]]] = {
    PLAN_FILE: (BACKENDS, _plan),
    "deepspeed.json": (("deepspeed",), _deepspeed),
    "accelerate.yaml": (("deepspeed", "fsdp"), _accelerate),
    "trainer_args.json": (("deepspeed", "fsdp"), _trainer_args),
    "launch.sh": (BACKENDS, _launch),
    "slurm.sbatch": (BACKENDS, _slurm),
    "megatron.yaml": (("megatron",), _megatron_yaml),
    "megatron_args.txt": (("megatron",), _megatron_args),
}
EXECUTABLE = {"launch.sh", "slurm.sbatch"}
GENERATED = frozenset(WRITERS)  # every name a generator writes: the only files a record lets `generate` remove


def files_of(backend: str) -> list[str]:
    """The files `dmt generate` writes for a plan of this backend."""
    return [name for name, (backends, _) in WRITERS.items() if backend in backends]


def resolve(recipe_path: Path, out_dir: Path = Path("."), calibration: Path | None = None,
            **overrides) -> GenerationContext:
    """The recipe, its model and plan (with overrides), and the calibration its predictions use (`calibration`: a
    --calibration file in place of the recipe's cluster.calibration)."""
    recipe = load_recipe(recipe_path)
    fitted = recipe_calibration(recipe, calibration)  # read before the model, which may import transformers (seconds)
    model = recipe_model(recipe)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return GenerationContext(recipe, Path(recipe_path), model, recipe_plan(recipe, model, fitted, **overrides),
                             Path(out_dir).resolve(), overrides, fitted)


def render(ctx: GenerationContext) -> dict[str, str]:
    """Every registered file of the plan's backend, as text (nothing written)."""
    return {name: WRITERS[name][1](ctx) for name in files_of(ctx.plan.backend)}


def generate(recipe_path: Path, out_dir: Path, force: bool = False, calibration: Path | None = None,
             **overrides) -> list[Path]:
    """Write every registered file of the plan's backend into out_dir, together (toolkit.outputs.write_generated):
    every content is rendered and every target checked before anything is written; the recipe and the model's
    config are never overwritten; files this tool did not write are replaced only with `force`; files it wrote for
    another backend are removed when unchanged since; a run directory or anything else of the user's stays."""
    from toolkit.outputs import output_directory, write_generated

    output_directory(out_dir, "--out", inputs=[Path(recipe_path)])  # a bad --out fails before the plan is resolved
    with recipe_names(overrides):  # a problem in the recipe names its key (cluster.gpu, not --gpu)
        ctx = resolve(recipe_path, out_dir, calibration, **overrides)
        contents = render(ctx)
    inputs = [Path(recipe_path), *([Path(ctx.calibration.source)] if ctx.calibration is not None else []),
              *recipe_files(ctx.recipe)]
    return write_generated(ctx.out_dir, contents, "--out", GENERATED, inputs=inputs, force=force,
                           executable=EXECUTABLE)
