"""Regenerate the committed example configs in deepspeed_configs/ (a test fails when they drift from the code).

Run: python -m toolkit.generate.examples
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.generate.deepspeed import deepspeed_config
from toolkit.spec.recipe import load_recipe, recipe_model, recipe_plan

ROOT = Path(__file__).resolve().parent.parent.parent
RECIPE = ROOT / "recipes" / "llama-3.1-8b-sft-8xh100.yaml"
# example file -> plan overrides of the 8B SFT recipe (8 x H100)
VARIANTS = {
    "zero0-bf16.json": dict(zero=0, recompute="full", micro_batch=1),
    "zero1-bf16.json": dict(zero=1),
    "zero2-bf16.json": dict(zero=2),
    "zero2-fp16.json": dict(zero=2, precision="fp16"),
    "zero2-offload-optimizer-cpu.json": dict(zero=2, offload_optimizer="cpu"),
    "zero3-bf16.json": dict(zero=3),
    "zero3-offload-cpu.json": dict(zero=3, offload_optimizer="cpu", offload_params="cpu"),
    "zero3-offload-nvme.json": dict(zero=3, offload_optimizer="nvme", offload_params="nvme", nvme_path="/local_nvme"),
}


def render_examples() -> dict[str, str]:
    recipe = load_recipe(RECIPE)
    model = recipe_model(recipe)
    return {name: json.dumps(deepspeed_config(recipe_plan(recipe, model, **overrides), recipe.training), indent=2) + "\n"
            for name, overrides in VARIANTS.items()}


def main() -> None:
    out = ROOT / "deepspeed_configs"
    out.mkdir(exist_ok=True)
    for name, text in render_examples().items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
