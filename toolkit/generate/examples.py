"""Regenerate the committed example configs in deepspeed_configs/ (a test fails when they drift from the code).

Run: python -m toolkit.generate.examples
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from toolkit.generate.deepspeed import deepspeed_config
from toolkit.numeric import json_text
from toolkit.planner.recipe import recipe_plan
from toolkit.spec.recipe import load_recipe, recipe_model
from toolkit.spec.recipe_training import DeepSpeedSection

ROOT = Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "deepspeed_configs"
SFT_8B = ROOT / "recipes" / "llama-3.1-8b-sft-8xh100.yaml"
PRETRAIN_70B = ROOT / "recipes" / "llama-3.1-70b-64xh100.yaml"


@dataclass(frozen=True)
class Example:
    """One committed config: which recipe, which plan overrides, and what `dmt validate` needs to check it."""

    recipe: Path
    overrides: dict = field(default_factory=dict)
    deepspeed: dict = field(default_factory=dict)  # recipe `deepspeed:` options (ZeRO++, "auto" values)
    fits: bool = True  # whether the memory model says it fits the recipe's GPU

    @property
    def model(self) -> str:
        return "llama-3.1-70b" if self.recipe == PRETRAIN_70B else "llama-3.1-8b"


EXAMPLES = {
    "zero0-bf16.json": Example(SFT_8B, dict(zero=0, micro_batch=1), fits=False),
    "zero1-bf16.json": Example(SFT_8B, dict(zero=1)),
    "zero2-bf16.json": Example(SFT_8B, dict(zero=2)),
    "zero2-fp16.json": Example(SFT_8B, dict(zero=2, precision="fp16")),
    "zero2-offload-optimizer-cpu.json": Example(SFT_8B, dict(zero=2, offload_optimizer="cpu")),
    "zero2-hf-auto.json": Example(SFT_8B, dict(zero=2), deepspeed=dict(auto_values=True)),
    "zero3-bf16.json": Example(SFT_8B, dict(zero=3)),
    "zero3-offload-cpu.json": Example(SFT_8B, dict(zero=3, offload_optimizer="cpu", offload_params="cpu")),
    "zero3-offload-nvme.json": Example(SFT_8B, dict(zero=3, offload_optimizer="nvme", offload_params="nvme",
                                                    nvme_path="/local_nvme")),
    # ZeRO++ pays off across nodes: Llama 3.1 70B on 8 nodes of 8 x H100, hpZ inside each node
    "zero3-zeropp-hpz-64gpu.json": Example(PRETRAIN_70B, dict(backend="deepspeed", zero=3, micro_batch=2,
                                                                recompute="full"),
                                           deepspeed=dict(zero_plus_plus=True)),
}


def example_context(example: Example):
    """(recipe, plan) of one example: the recipe with its overrides, resolved like `dmt generate` does."""
    recipe = load_recipe(example.recipe)
    recipe = recipe.model_copy(update={"plan": recipe.plan.model_copy(update={"auto": False}),
                                       "deepspeed": DeepSpeedSection(**example.deepspeed)})
    return recipe, recipe_plan(recipe, recipe_model(recipe), **example.overrides)


def render_examples() -> dict[str, str]:
    rendered = {}
    for name, example in EXAMPLES.items():
        recipe, plan = example_context(example)
        rendered[name] = json_text(deepspeed_config(plan, recipe.training, recipe.deepspeed), indent=2) + "\n"
    return rendered


def write_examples(out: Path, rendered: dict[str, str]) -> None:
    """Write every rendered example file into `out`, and remove the files there that are no longer one."""
    out.mkdir(exist_ok=True)
    for stale in {p.name for p in out.iterdir() if p.is_file()} - set(rendered):
        (out / stale).unlink()
        print(f"removed {out / stale}")
    for name, text in rendered.items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")


def examples_readme(title: str, intro: str, about: dict[str, str]) -> str:
    """A README of generated examples: the title, what they are, and one line per example."""
    return "\n".join([f"# {title}", "", intro, "", *(f"- `{name}`: {text}." for name, text in about.items())]) + "\n"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for stale in set(p.name for p in OUT.glob("*.json")) - set(EXAMPLES):
        (OUT / stale).unlink()
        print(f"removed {OUT / stale}")
    for name, text in render_examples().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
