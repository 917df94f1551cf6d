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

from toolkit.errors import named_as
from toolkit.generate.k8s.render import make_job, manifest_text
from toolkit.generate.launch import launch_script
from toolkit.generate.slurm import render_sbatch
from toolkit.numeric import json_text
from toolkit.outputs import output_directory, write_generated
from toolkit.planner.recipe import recipe_plan, recipe_prediction
from toolkit.planner.save_interval import AUTO, auto_save_interval, is_auto, recipe_saves_async, with_save_steps
from toolkit.spec.backends import BACKENDS, backend_of
from toolkit.spec.calibration import Calibration
from toolkit.spec.lr_scaling import lr_schedule, with_scaled_lr
from toolkit.spec.model import ModelSpec
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
    save_interval: dict | None = None  # `training.save_steps: auto` resolved (recipe holds the number), and why
    lr_scaling: dict | None = None  # the learning rate and warm-up scaled to the global batch (recipe holds them)





def _launch(ctx: GenerationContext) -> str:
    return launch_script(ctx.recipe, ctx.plan, str(ctx.recipe_path.resolve()))


def _slurm(ctx: GenerationContext) -> str:
    with named_as({"--output-dir": "--out"}):  # the job trains into --out/run
        return render_sbatch(ctx.recipe, ctx.plan, ctx.recipe_path, output_dir=str(ctx.out_dir / "run"),
                             train_flags=["--plan", str(ctx.out_dir / PLAN_FILE)])


def _k8s(ctx: GenerationContext) -> str:
    """The plan as a Kubeflow TrainJob (with its TrainingRuntime), training these files: written only when the recipe
    names an image (cluster.k8s.image; see written())."""
    with named_as({"RECIPE": "--recipe", "--plan": "--out", "--image": "cluster.k8s.image"}):
        return manifest_text(make_job(ctx.recipe, ctx.plan, None, ctx.recipe_path, ctx.out_dir / PLAN_FILE), "trainjob")


def _plan(ctx: GenerationContext) -> str:
    record = recipe_prediction(ctx.recipe, ctx.model, ctx.plan, ctx.calibration, PlanFile, recipe=ctx.recipe.name,
                               auto=ctx.recipe.plan.auto, recipe_path=str(ctx.recipe_path.resolve()),
                               recipe_settings=_settings_as_written(ctx), overrides=ctx.overrides,
                               files=[name for name in files_of(ctx.plan.backend)
                                      if name != PLAN_FILE and written(ctx, name)],
                               save_interval=ctx.save_interval, lr_scaling=ctx.lr_scaling)
    return json_text(record.as_json(), indent=2) + "\n"


def _settings_as_written(ctx: GenerationContext) -> dict:
    """The recipe's settings as its file says them (`save_steps: auto`, not the number resolved from it)."""
    settings = recipe_settings(ctx.recipe)
    if ctx.save_interval is not None:
        settings["training"]["save_steps"] = AUTO
    if ctx.lr_scaling is not None:  # the recipe's own numbers, not the scaled ones the generators wrote
        settings["training"].update(learning_rate=ctx.lr_scaling["recipe_learning_rate"],
                                    warmup_steps=ctx.lr_scaling["recipe_warmup_steps"])
    return settings


def recipe_settings(recipe: Recipe) -> dict:
    """What plan.json records of the recipe, to tell later whether the recipe changed since (its location and the
    Kubernetes image aside: neither changes what trains)."""
    return recipe.model_dump(mode="json", exclude={"base_dir": True, "cluster": {"k8s"}})





PLAN_FILE = "plan.json"
# the files every plan gets (file name -> writer); each backend adds its own (toolkit/backends/<name>/generate.py)
K8S_FILE = "k8s-trainjob.yaml"
COMMON: dict[str, Callable[[GenerationContext], str]] = {PLAN_FILE: _plan, "launch.sh": _launch, "slurm.sbatch": _slurm,
                                                         K8S_FILE: _k8s}
# files written only for some recipes: name -> whether this one gets it
CONDITIONS: dict[str, Callable[[GenerationContext], bool]] = {K8S_FILE: lambda ctx: bool(ctx.recipe.cluster.k8s.image)}
EXECUTABLE = {"launch.sh", "slurm.sbatch"}
# every name a generator writes: the only files a record lets `generate` remove
GENERATED = frozenset(COMMON) | {name for backend in BACKENDS.values() for name in backend.files}


def writers_of(backend: str) -> dict[str, Callable[[GenerationContext], str]]:
    """The files `dmt generate` writes for a plan of this backend, each with its writer, plan.json first."""
    first, *rest = COMMON.items()  # plan.json, the backend's files, then the launchers'
    return dict([first, *backend_of(backend).generate.WRITERS.items(), *rest])


def written(ctx: GenerationContext, name: str) -> bool:
    """Whether `dmt generate` writes this file for this recipe (every registered file but the conditional ones)."""
    return name not in CONDITIONS or CONDITIONS[name](ctx)


def files_of(backend: str) -> list[str]:
    """The files `dmt generate` writes for a plan of this backend."""
    return list(writers_of(backend))


def resolve(recipe_path: Path, out_dir: Path = Path("."), calibration: Path | None = None,
            **overrides) -> GenerationContext:
    """The recipe, its model and plan (with overrides), and the calibration its predictions use (`calibration`: a
    --calibration file in place of the recipe's cluster.calibration)."""
    recipe = load_recipe(recipe_path)
    fitted = recipe_calibration(recipe, calibration)  # read before the model, which may import transformers (seconds)
    model = recipe_model(recipe)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    plan = recipe_plan(recipe, model, fitted, **overrides)
    save_interval = None
    if is_auto(recipe):  # resolved here once; every writer then reads the number from the recipe
        save_interval = auto_save_interval(recipe_prediction(recipe, model, plan, fitted), recipe.training.max_steps,
                                           recipe_saves_async(recipe, plan))
        recipe = with_save_steps(recipe, save_interval["save_steps"])
    lr_scaling = lr_schedule(recipe.training)  # resolved here once; every writer reads the scaled numbers
    return GenerationContext(recipe if lr_scaling is None else with_scaled_lr(recipe), Path(recipe_path), model, plan,
                             Path(out_dir).resolve(), overrides, fitted, save_interval, lr_scaling)


def render(ctx: GenerationContext) -> dict[str, str]:
    """Every registered file of the plan's backend, as text (nothing written)."""
    return {name: write(ctx) for name, write in writers_of(ctx.plan.backend).items() if written(ctx, name)}


def generate(recipe_path: Path, out_dir: Path, force: bool = False, calibration: Path | None = None,
             **overrides) -> list[Path]:
    """Write every registered file of the plan's backend into out_dir, together (toolkit.outputs.write_generated):
    every content is rendered and every target checked before anything is written; the recipe and the model's
    config are never overwritten; files this tool did not write are replaced only with `force`; files it wrote for
    another backend are removed when unchanged since; a run directory or anything else of the user's stays."""
    output_directory(out_dir, "--out", inputs=[Path(recipe_path)])  # a bad --out fails before the plan is resolved
    with recipe_names(overrides):  # a problem in the recipe names its key (cluster.gpu, not --gpu)
        ctx = resolve(recipe_path, out_dir, calibration, **overrides)
        contents = render(ctx)
    inputs = [Path(recipe_path), *([Path(ctx.calibration.source)] if ctx.calibration is not None else []),
              *recipe_files(ctx.recipe)]
    return write_generated(ctx.out_dir, contents, "--out", GENERATED, inputs=inputs, force=force,
                           executable=EXECUTABLE)
