"""`dmt generate`: resolve a recipe once and write every launch file from that one plan, each atomically.

Writers form a registry (file name -> function of the context); other parts of the toolkit register theirs
(megatron.yaml, megatron_args.txt, slurm.sbatch) here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe, load_recipe, recipe_model, recipe_plan


@dataclass(frozen=True)
class GenerationContext:
    recipe: Recipe
    recipe_path: Path
    model: ModelSpec
    plan: Plan
    out_dir: Path


def _deepspeed(ctx: GenerationContext) -> str:
    from toolkit.generate.deepspeed import deepspeed_config

    return json.dumps(deepspeed_config(ctx.plan, ctx.recipe.training), indent=2) + "\n"


def _accelerate(ctx: GenerationContext) -> str:
    from toolkit.generate.accelerate import accelerate_config

    return yaml.safe_dump(accelerate_config(ctx.recipe, ctx.plan, str(ctx.out_dir / "deepspeed.json")), sort_keys=False)


def _trainer_args(ctx: GenerationContext) -> str:
    from toolkit.generate.trainer_args import trainer_arguments

    args = trainer_arguments(ctx.recipe, ctx.plan, str(ctx.out_dir / "run"), str(ctx.out_dir / "deepspeed.json"))
    return json.dumps(args, indent=2) + "\n"


def _launch(ctx: GenerationContext) -> str:
    from toolkit.generate.launch import launch_script

    return launch_script(ctx.recipe, ctx.plan, str(ctx.recipe_path.resolve()))


def _plan(ctx: GenerationContext) -> str:
    from toolkit.estimate.comm import Network
    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.timing import step_time
    from toolkit.planner.report import plan_record
    from toolkit.spec.cluster import get_gpu

    gpu = get_gpu(ctx.recipe.cluster.gpu)
    network = Network(gpu.intra_node_bw_gbps, gpu.inter_node_bw_gbps, ctx.recipe.cluster.gpus_per_node)
    record = plan_record(ctx.model, ctx.plan, estimate_memory(ctx.model, ctx.plan),
                         step_time(ctx.model, ctx.plan, gpu, network), gpu)
    record["recipe"] = ctx.recipe.name
    record["auto"] = ctx.recipe.plan == "auto" or ctx.recipe.plan.auto
    return json.dumps(record, indent=2) + "\n"


# file name -> (backends it belongs to, writer)
WRITERS: dict[str, tuple[tuple[str, ...], Callable[[GenerationContext], str]]] = {
    "plan.json": (("deepspeed", "megatron"), _plan),
    "deepspeed.json": (("deepspeed",), _deepspeed),
    "accelerate.yaml": (("deepspeed",), _accelerate),
    "trainer_args.json": (("deepspeed",), _trainer_args),
    "launch.sh": (("deepspeed",), _launch),
}
EXECUTABLE = {"launch.sh", "slurm.sbatch"}


def resolve(recipe_path: Path, **overrides) -> GenerationContext:
    recipe = load_recipe(recipe_path)
    model = recipe_model(recipe)
    return GenerationContext(recipe, recipe_path, model, recipe_plan(recipe, model, **overrides), Path("."))


def generate(recipe_path: Path, out_dir: Path, **overrides) -> list[Path]:
    """Write every registered file into out_dir; each file appears whole or not at all, other files are kept."""
    ctx = resolve(recipe_path, **overrides)
    out_dir = out_dir.resolve()
    ctx = GenerationContext(ctx.recipe, recipe_path, ctx.model, ctx.plan, out_dir)
    contents = {name: writer(ctx) for name, (backends, writer) in WRITERS.items() if ctx.plan.backend in backends}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in contents.items():
        path = out_dir / name
        tmp = out_dir / f".{name}.tmp-{os.getpid()}"
        tmp.write_text(text)
        if name in EXECUTABLE:
            tmp.chmod(0o755)
        os.replace(tmp, path)
        written.append(path)
    return written
