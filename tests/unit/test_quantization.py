"""fp8 and fp4 plans: the recipes in Megatron-Core's own words, Transformer Engine's hardware rules as one-line
refusals, and what each recipe stores (weights beside or instead of bf16, GEMM inputs saved in fp8)."""

from pathlib import Path
from typing import get_args

import pytest
import yaml

from helpers import ROOT
from megatron_lm_args import CONNECTIONS_ASSERT
from megatron_lm_args import problems as megatron_lm_problems
from toolkit.cli.main import main
from toolkit.estimate.comm import Network
from toolkit.estimate.memory import estimate_memory, stage_params
from toolkit.estimate.params import count_params
from toolkit.estimate.timing import step_time
from toolkit.spec.cluster import capability, get_gpu
from toolkit.spec.model import load_model_spec
from toolkit.spec.options import choices
from toolkit.spec.plan import resolve_plan
from toolkit.spec.quantization import RECIPES

GiB = 2**30
# Megatron-Bridge's Llama 3 70B FP8 benchmark on 64 H100 (perf_recipes/llama/h100/llama3.py, fp8_cs: tensorwise with
# fp8_param_gather; 1,664 tokens/s/GPU in the 26.04.01 performance summary): it ran, so it must fit
BRIDGE_70B = dict(backend="megatron", tp=4, pp=8, vpp=5, micro_batch=1, global_batch=256, seq_len=8192,
                  distributed_optimizer=True, sequence_parallel=True, recompute="none")


def test_the_recipes_are_megatron_cores_own():
    """Every recipe Megatron-Core 0.16.1's TransformerConfig names, but `custom` (a user's quantizer factory)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    def literal(name: str) -> set:  # Optional[Literal[...]]: the Literal's values
        return {value for arg in get_args(TransformerConfig.__dataclass_fields__[name].type) for value in get_args(arg)}

    assert set(choices("fp8_recipe")) == literal("fp8_recipe") - {"custom"}
    assert set(choices("fp4_recipe")) == literal("fp4_recipe") - {"custom"}
    assert set(RECIPES) == set(choices("fp8_recipe")) | set(choices("fp4_recipe"))


def _estimate(capsys, *flags: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--backend", "megatron", "--tp", "2", *flags])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("flags, says", [
    (("--precision", "fp8", "--fp8-recipe", "mxfp8"), "--fp8-recipe: mxfp8 is Blackwell's (compute capability 10.x); "
                                                      "h100-80gb is compute capability 9.0"),
    (("--precision", "fp4"), "--fp4-recipe: nvfp4 is Blackwell's (compute capability 10.0 or higher); h100-80gb"),
    (("--precision", "fp4", "--gpu", "mi355x"), "--fp4-recipe: nvfp4 is Blackwell's (compute capability 10.0 or "
                                                "higher); mi355x is an amd part: use --precision fp8"),
    (("--precision", "fp8", "--fp8-recipe", "blockwise", "--gpu", "l40s"),
     "--fp8-recipe: blockwise needs Transformer Engine's block-scaled GEMM (compute capability 9.0 or higher); l40s"),
    (("--precision", "fp8", "--gpu", "a100-80gb"), "--precision: fp8 needs fp8 tensor cores"),
    (("--precision", "fp8", "--gpu", "cpu"), "--precision: fp8 runs CUDA kernels"),
    (("--fp8-recipe", "tensorwise"), "--fp8-recipe: applies to --precision fp8, not bf16"),
    (("--precision", "fp8", "--fp4-recipe", "nvfp4"), "--fp4-recipe: applies to --precision fp4, not fp8"),
    (("--fp8-param-gather", "--distributed-optimizer"), "--fp8-param-gather: keeps the weights in fp8: it needs "
                                                        "--precision fp8"),
    (("--precision", "fp8", "--fp8-param-gather"), "--fp8-param-gather: is only supported with the distributed "
                                                   "optimizer"),
    (("--precision", "fp8", "--transformer-impl", "local"), "--precision: fp8 needs Transformer Engine layer modules"),
])
def test_each_refusal_is_one_line_naming_the_option(capsys, flags, says):
    code, lines = _estimate(capsys, *flags)
    assert code == 2 and len(lines) == 1 and says in lines[0], lines


@pytest.mark.parametrize("gpu, options, peak", [
    ("h100-80gb", dict(precision="fp8", fp8_recipe="blockwise"), "fp8"),  # Hopper has the block-scaled GEMM
    ("b200", dict(precision="fp8", fp8_recipe="mxfp8"), "mxfp8"),
    ("b200", dict(precision="fp4"), "nvfp4"),
    ("l40s", dict(precision="fp8", fp8_recipe="tensorwise"), "fp8"),  # Ada: per-tensor fp8
])
def test_what_transformer_engine_runs_is_estimated(capsys, gpu, options, peak):
    """Estimated without a word, and at the recipe's own peak: faster than the same plan in bf16 (B200's fp4 GEMMs at
    its 9,000 dense TFLOP/s, not bf16's 2,250)."""
    flags = [f for key, value in options.items() for f in (f"--{key.replace('_', '-')}", value)]
    code, lines = _estimate(capsys, *flags, "--gpu", gpu)
    assert code == 0 and lines == []
    model, part = load_model_spec("llama-3.1-8b"), get_gpu(gpu)
    plan = dict(backend="megatron", tp=2, micro_batch=1, seq_len=8192, distributed_optimizer=True)
    network = Network.from_catalogue(part, 8)
    bf16 = step_time(model, resolve_plan(model, 8, **plan), part, network)
    low = step_time(model, resolve_plan(model, 8, **plan, **options), part, network)
    assert low.peak_tflops == part.peak_tflops[peak] > part.peak_tflops["bf16"]
    assert bf16.compute_s / (part.peak_tflops[peak] / part.peak_tflops["bf16"]) < low.compute_s < bf16.compute_s


def test_a_part_without_the_recipes_peak_is_refused_not_priced_at_bf16():
    """A catalogue entry that lists no peak for the plan's GEMMs: one line naming the recipe, never bf16's rate."""
    from toolkit.errors import UserInputError
    from toolkit.estimate.device_peak import peak_flops
    from toolkit.spec.quantization import check_on_gpu

    model, b200 = load_model_spec("llama-3.1-8b"), get_gpu("b200")
    bare = b200.model_copy(update={"peak_tflops": {k: v for k, v in b200.peak_tflops.items() if k != "nvfp4"}})
    plan = resolve_plan(model, 8, backend="megatron", tp=2, precision="fp4", distributed_optimizer=True)
    with pytest.raises(UserInputError, match="b200's catalogue entry has no dense nvfp4 peak for nvfp4's GEMMs"):
        check_on_gpu(plan, bare)
    with pytest.raises(UserInputError, match="no dense nvfp4 peak for fp4"):
        peak_flops(bare, "fp4")
    check_on_gpu(plan, b200)


def test_the_other_backends_refuse_the_recipes(capsys):
    capsys.readouterr()
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--fp8-recipe", "delayed"]) == 2
    assert "--fp8-recipe: is a recipe of --precision fp8, which DeepSpeed does not train here" in \
        capsys.readouterr().err


def test_megatron_bridges_70b_fp8_layout_fits_as_it_ran():
    """The layout NVIDIA benchmarks (no recomputation, 47 forwards of 2 layers in flight on the first rank) fits an
    80 GB H100 with Bridge's recipe; bf16 does not."""
    model, gpu = load_model_spec("llama-3.1-70b"), get_gpu("h100-80gb")
    fp8 = resolve_plan(model, 64, precision="fp8", fp8_recipe="tensorwise", fp8_param_gather=True, **BRIDGE_70B)
    bf16 = resolve_plan(model, 64, **BRIDGE_70B)
    assert estimate_memory(model, fp8).total <= gpu.memory_bytes < estimate_memory(model, bf16).total


def test_weights_are_bf16_plus_the_recipes_copies_or_the_copies_alone():
    model = load_model_spec("llama-3.1-70b")
    plans = {name: resolve_plan(model, 64, **BRIDGE_70B, **options) for name, options in {
        "bf16": {}, "delayed": dict(precision="fp8"),
        "gathered": dict(precision="fp8", fp8_param_gather=True),
        "mxfp8": dict(precision="fp8", fp8_recipe="mxfp8"), "nvfp4": dict(precision="fp4")}.items()}
    weights = {name: estimate_memory(model, plan).weights for name, plan in plans.items()}
    stage = estimate_memory(model, plans["bf16"]).stage
    gemm = stage_params(model, count_params(model), plans["bf16"], stage).gemm
    total = stage_params(model, count_params(model), plans["bf16"], stage).total
    assert 0.85 * total < gemm < total  # the embedding (a tenth of the first stage here) and norms stay bf16
    # delayed on Hopper: the row-wise copy and its transpose, beside bf16
    assert weights["delayed"] - weights["bf16"] == pytest.approx(2 * gemm, abs=1)
    # fp8 weights themselves: no bf16 copy of the GEMM weights
    assert weights["gathered"] - weights["bf16"] == pytest.approx(0, abs=1)
    # MXFP8's two layouts each carry a scale byte per 32 elements
    assert weights["mxfp8"] - weights["delayed"] == pytest.approx(gemm * 2 / 32, abs=1)
    assert weights["nvfp4"] - weights["bf16"] == pytest.approx(gemm * 2 * (0.5 + 1 / 16), abs=1)


def test_fp8_saves_its_gemm_inputs_in_one_byte():
    """The norms' outputs and fc2's input shrink to a byte; the output projection's fp8 copy is added beside the
    attention's bf16 output; fc1's output (the activation's input) stays bf16."""
    model = load_model_spec("llama-3.1-70b")
    bf16 = estimate_memory(model, resolve_plan(model, 64, **BRIDGE_70B)).activations
    fp8 = estimate_memory(model, resolve_plan(model, 64, precision="fp8", **BRIDGE_70B)).activations
    h, ffn, q = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads * model.head_dim
    # per token and layer: two norms save h bytes fewer each, fc2 ffn fewer, the projection q more
    assert (bf16 - fp8) / bf16 == pytest.approx((2 * h + ffn - q) / (
        # bf16 per token and layer, as toolkit/estimate/activations.py counts it (norms 2 x (2h + 2h), fp32 rstd)
        2 * (4 * h + 4) + 2 * (q + 2 * model.num_kv_heads * model.head_dim) + 4 * model.num_attention_heads + 2 * q
        + 2 * 3 * ffn), rel=0.02)


def test_fp8_gemms_run_at_the_fp8_peak_and_attention_at_bf16s():
    model, gpu = load_model_spec("llama-3.1-8b"), get_gpu("h100-80gb")
    network = Network.from_catalogue(gpu, 8)
    plan = dict(backend="megatron", tp=1, micro_batch=1, seq_len=8192, distributed_optimizer=True)
    bf16 = step_time(model, resolve_plan(model, 8, **plan), gpu, network)
    fp8 = step_time(model, resolve_plan(model, 8, precision="fp8", **plan), gpu, network)
    # the GEMMs twice as fast, attention and the rest not: between the two
    assert bf16.compute_s / 2 < fp8.compute_s < bf16.compute_s
    assert fp8.peak_tflops == gpu.peak_tflops["fp8"]


QWEN3_MOE = ROOT / "recipes" / "qwen3-30b-a3b-megatron-gb200-nvl72.yaml"
# (GPU, precision flags): each recipe on a GPU whose Transformer Engine has its kernels (check_on_gpu)
MOE_RECIPES = [
    ("h100-80gb", ("--precision", "fp8", "--fp8-recipe", "delayed")),
    ("h100-80gb", ("--precision", "fp8", "--fp8-recipe", "tensorwise")),
    ("h100-80gb", ("--precision", "fp8", "--fp8-recipe", "blockwise")),
    ("h100-80gb", ("--precision", "fp8", "--fp8-recipe", "tensorwise", "--fp8-param-gather")),
    ("b200", ("--precision", "fp8", "--fp8-recipe", "mxfp8")),
    ("b200", ("--precision", "fp4", "--fp4-recipe", "nvfp4")),
]


def _moe_recipe(tmp_path, gpu: str) -> Path:
    """The Qwen3-30B-A3B MoE recipe on 64 GPUs of one HGX-style part (8 a node, its own NVLink domain)."""
    recipe = yaml.safe_load(QWEN3_MOE.read_text())
    recipe["cluster"] = {"gpus": 64, "gpu": gpu}
    path = tmp_path / f"qwen3-moe-{gpu}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("gpu, flags", MOE_RECIPES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_an_moe_plan_in_each_recipe_generates_and_validates(tmp_path, capsys, gpu, flags):
    """Megatron-Core 0.16.1's TransformerConfig checks Transformer Engine's version for MoE fp8; without TE (here)
    `dmt validate` answers that check as the oldest TE Megatron-Core builds the recipe with, instead of failing on
    None >= Version. Megatron-LM's parser table (tests/megatron_lm_args.py) accepts every flag written."""
    out = tmp_path / "out"
    assert main(["generate", str(_moe_recipe(tmp_path, gpu)), "--out", str(out), *flags]) == 0
    capsys.readouterr()
    assert main(["validate", str(out)]) == 0, capsys.readouterr().err
    args = (out / "megatron_args.txt").read_text()
    assert megatron_lm_problems(args) == []
    tc = yaml.safe_load((out / "megatron.yaml").read_text())["transformer_config"]
    precision, recipe = flags[1], flags[3]
    assert tc["num_moe_experts"] and tc[f"{precision}_recipe"] == recipe and f"--{precision}-recipe {recipe}" in args
    assert ("--fp8-param-gather" in args.splitlines()) is ("--fp8-param-gather" in flags)
    if capability(get_gpu(gpu)) < (10, 0):  # validate_args: TP before Blackwell needs one connection per device
        assert CONNECTIONS_ASSERT in (out / "launch.sh").read_text()


def test_a_transformer_engine_check_answers_as_the_recipes_oldest_te():
    """The assumed version is the recipe's oldest: a Megatron-Core check that needs a newer TE still refuses, and
    says which version it assumed (tensorwise 2.2 with moe_act recomputed, which needs TE 2.6)."""
    from toolkit.validate.megatron import _library_checks

    config = {"transformer_config": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_grouped_gemm=True,
                                         bf16=True, fp8="hybrid", fp8_recipe="tensorwise", recompute_granularity=
                                         "selective", recompute_modules=["moe_act"]),
              "ddp_config": {}, "optimizer_config": {"optimizer": "adam", "lr": 1e-4}}
    [problem] = _library_checks(config)
    assert "transformer-engine>=2.6.0dev0" in problem.message and "taken as 2.2.0.dev0" in problem.message
    config["transformer_config"].update(fp8_recipe="delayed", recompute_modules=["core_attn"])
    assert _library_checks(config) == []


@pytest.mark.parametrize("precision, says", [
    ("fp4", "(Megatron-Core has no fp4 primary weights: the bf16 one stays)"),
    ("fp8", "(--fp8-param-gather drops the bf16 one)"),
])
def test_explain_offers_fp8_param_gather_only_where_it_is_accepted(capsys, precision, says):
    """--fp8-param-gather is refused with fp4: fp4's --explain names no remedy that would be refused."""
    capsys.readouterr()
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--backend", "megatron", "--tp", "2",
                 "--gpu", "b200", "--precision", precision, "--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert says in out and ("--fp8-param-gather" in out) is (precision == "fp8")
