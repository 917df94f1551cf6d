"""Regenerate the committed examples in megatron_configs/ (a test fails when they drift from the code).

Run: python -m toolkit.generate.megatron_examples
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from toolkit.generate.examples import examples_readme, write_examples
from toolkit.generate.megatron import megatron_config, megatron_yaml
from toolkit.generate.megatron_args import megatron_args_text
from toolkit.planner.recipe import recipe_plan
from toolkit.spec.recipe import load_recipe, recipe_hf_config, recipe_model

ROOT = Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "megatron_configs"
RECIPES = ROOT / "recipes"


@dataclass(frozen=True)
class MegatronExample:
    """One committed pair NAME.yaml + NAME.args.txt: which recipe, and which plan options override its plan."""

    recipe: str
    overrides: dict = field(default_factory=dict)
    about: str = ""
    model: str | None = None  # another model (a preset) on the recipe's data, training and plan
    gpus: int | None = None  # another cluster size


EXAMPLES = {
    "mixtral-8x7b-ep8-tp2": MegatronExample(
        "mixtral-8x7b-megatron.yaml", {},
        "Mixtral 8x7B on 16 x H100: EP 8 x TP 2 with sequence parallelism, distributed optimizer, selective "
        "recompute (the recipe's own plan)"),
    # Megatron-Core's parallel folding: the experts on ETP 1 x EP over the ranks attention spends on TP 2
    "mixtral-8x7b-tp2-ep8-etp1": MegatronExample(
        "mixtral-8x7b-megatron.yaml", dict(tp=2, ep=8, etp=1),
        "Mixtral 8x7B on 16 x H100, folded: attention TP 2 x DP 8, experts ETP 1 x EP 8 x EDP 2 over the same ranks"),
    "qwen3-30b-a3b-tp2-ep16-etp1": MegatronExample(
        "mixtral-8x7b-megatron.yaml", dict(tp=2, ep=16, etp=1),
        "Qwen3-30B-A3B on 16 x H100, folded: EP 16 reaches beyond DP 8 into the TP 2 ranks (ETP 1)",
        model="qwen3-30b-a3b"),
    "qwen3-235b-a22b-pp8-vpp4-ep8-etp1": MegatronExample(
        "mixtral-8x7b-megatron.yaml",
        dict(tp=2, pp=8, vpp=4, ep=8, etp=1, account_for_embedding_in_pipeline_split=True,
             account_for_loss_in_pipeline_split=True, recompute="selective",
             recompute_modules=("moe_act", "layernorm"), global_batch=1024),
        "Qwen3-235B-A22B on 256 x H100: PP 8 x VPP 4 (94 layers + embedding + loss = 8 x 4 x 3), attention TP 2, "
        "experts ETP 1 x EP 8 folded, MoE activation and norm recompute", model="qwen3-235b-a22b", gpus=256),
    "qwen3-235b-a22b-pp16-vpp2-layout": MegatronExample(
        "mixtral-8x7b-megatron.yaml",
        dict(tp=2, pp=16, ep=8, etp=1, pipeline_model_parallel_layout="Et*2|(ttt|)*30,ttL", global_batch=1024),
        "Qwen3-235B-A22B on 256 x H100 with Megatron-Core's pipeline layout: PP 16 x VPP 2, the embedding and the "
        "loss each in a layer's place (--pipeline-model-parallel-layout)", model="qwen3-235b-a22b", gpus=256),
    "deepseek-v3-tp2-pp16-ep64-etp1": MegatronExample(
        "mixtral-8x7b-megatron.yaml",
        dict(tp=2, pp=16, ep=64, etp=1, sequence_parallel=True, first_stage_layers=1, last_stage_layers=4,
             recompute="selective", global_batch=4096),
        "DeepSeek-V3 on 1024 x H100: multi-latent attention (MLATransformerConfig, --multi-latent-attention), "
        "TP 2 x PP 16 (1 + 14 x 4 + 4 of the 61 layers, the MTP layer on the last stage), experts ETP 1 x EP 64 "
        "folded, 3 dense layers then MoE (--moe-layer-freq as a list pattern)", model="deepseek-v3", gpus=1024),
    "llama-3.1-70b-tp8-pp4-vpp5": MegatronExample(
        "llama-3.1-70b-64xh100.yaml",
        dict(backend="megatron", zero=0, tp=8, pp=4, vpp=5, micro_batch=1, sequence_parallel=True,
             distributed_optimizer=True, recompute="selective"),
        "Llama 3.1 70B on 64 x H100: TP 8 x PP 4 with 5 interleaved stages per rank (80 layers = 4 x 5 x 4), DP 2"),
    "llama-3.1-70b-tp4-pp8-vpp5-fp8": MegatronExample(
        "llama-3.1-70b-64xh100.yaml",
        dict(backend="megatron", zero=0, tp=4, pp=8, vpp=5, micro_batch=1, sequence_parallel=True,
             distributed_optimizer=True, recompute="none", precision="fp8", fp8_recipe="tensorwise",
             fp8_param_gather=True),
        "Llama 3.1 70B on 64 x H100 as Megatron-Bridge benchmarks it: TP 4 x PP 8 with 5 interleaved stages, no "
        "recomputation, fp8 tensorwise (current) scaling with fp8 weights gathered in fp8 (--fp8-param-gather)"),
    "llama-3.1-8b-tp2-cp2-fp8": MegatronExample(
        "llama-3.1-8b-sft-8xh100.yaml",
        dict(backend="megatron", zero=0, tp=2, cp=2, precision="fp8", sequence_parallel=True,
             distributed_optimizer=True, recompute="none"),
        "Llama 3.1 8B on 8 x H100: TP 2 x CP 2 x DP 2, fp8 (Transformer Engine, hybrid E4M3/E5M2)"),
    "llama-3.1-8b-tp2-pp4-uneven": MegatronExample(
        "llama-3.1-8b-sft-8xh100.yaml",
        dict(backend="megatron", zero=0, tp=2, pp=4, first_stage_layers=7, last_stage_layers=7,
             distributed_optimizer=False, recompute="full"),
        "Llama 3.1 8B on 8 x H100: TP 2 x PP 4 with an uneven split (7 + 9 + 9 + 7 layers: the first and last "
        "stages also hold the embedding and the output layer), full recompute"),
    "tiny-llama-megatron-cpu-tp2": MegatronExample(
        "tiny-llama-megatron-cpu.yaml", dict(tp=2),
        "The tiny CPU recipe at TP 2, as tests/megatron trains it (local layer spec, CPU initialisation, fp32)"),
}


def example_config(example: MegatronExample) -> tuple[str, dict]:
    """(recipe name, megatron.yaml dict) of one example: the recipe with its overrides, resolved like `dmt generate`."""
    recipe = load_recipe(RECIPES / example.recipe)
    recipe = recipe.model_copy(update={"plan": recipe.plan.model_copy(update={"auto": False})})
    if example.model is not None:
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"source": example.model})})
    if example.gpus is not None:
        recipe = recipe.model_copy(update={"cluster": recipe.cluster.model_copy(update={"gpus": example.gpus})})
    model = recipe_model(recipe)
    plan = recipe_plan(recipe, model, **example.overrides)
    return recipe.name, megatron_config(recipe, model, plan, recipe_hf_config(recipe))


def render_examples() -> dict[str, str]:
    """File name -> text of every committed example."""
    rendered = {}
    for name, example in EXAMPLES.items():
        recipe_name, config = example_config(example)
        rendered[f"{name}.yaml"] = megatron_yaml(config, recipe_name)
        rendered[f"{name}.args.txt"] = megatron_args_text(config, recipe_name)
    rendered["README.md"] = _readme()
    return rendered


def _readme() -> str:
    return examples_readme(
        "Megatron-Core config examples",
        "Generated by `python -m toolkit.generate.megatron_examples` from the recipes in `recipes/` (the table "
        "`EXAMPLES` there names each file's recipe and plan overrides); `dmt generate` writes the same pair as "
        "`megatron.yaml` and `megatron_args.txt`. Each `NAME.yaml` holds the keyword arguments of the "
        "Megatron-Core classes the training backend builds; `NAME.args.txt` the equivalent Megatron-LM "
        "`pretrain_gpt.py` flags. `tests/megatron/test_megatron_generate.py` regenerates them, fails on any "
        "drift, and validates each at its own world size.",
        {name: example.about for name, example in EXAMPLES.items()})


def main() -> None:
    write_examples(OUT, render_examples())


if __name__ == "__main__":
    main()
