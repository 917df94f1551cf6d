"""Every recompute plan `dmt plan` can propose (none, selective core attention, selective MLP, the block method,
full) generates a megatron.yaml that real Megatron-Core builds and runs forward and backward on 2 gloo ranks, with
the gradients of no recomputation, and keeps for backward what the memory model says (Megatron-Core's `local`
layer spec, the one that runs on CPU)."""

from pathlib import Path

import pytest
from megatron_helpers import TINY_MEGATRON

pytestmark = pytest.mark.launch
SCRIPT = Path(__file__).resolve().parent / "mcore_recompute.py"


def _loss_recipe(directory: Path) -> Path:
    """TINY_MEGATRON with a vocabulary whose fp32 logits outweigh everything else its layers keep."""
    from mcore_recompute import LOSS_VOCAB

    path = directory / "loss-recipe.yaml"
    path.write_text(TINY_MEGATRON.read_text().replace("vocab_size: 512", f"vocab_size: {LOSS_VOCAB}")
                    .replace("data/tiny_corpus.txt", str(TINY_MEGATRON.parent / "data/tiny_corpus.txt")))
    return path


# a tiny qwen3_moe (4 experts, top 2, q/k norms) under the same recipe, at EP 2 (mcore_recompute.MOE_PLANS)
TINY_QWEN3_MOE = """    architectures: [Qwen3MoeForCausalLM]
    model_type: qwen3_moe
    moe_intermediate_size: 48
    num_experts: 4
    num_experts_per_tok: 2
    decoder_sparse_step: 1
    mlp_only_layers: []
    norm_topk_prob: true
    head_dim: 16
"""


def _moe_recipe(directory: Path) -> Path:
    path = directory / "moe-recipe.yaml"
    text = TINY_MEGATRON.read_text()
    path.write_text(text.replace("    architectures: [LlamaForCausalLM]\n    model_type: llama\n", TINY_QWEN3_MOE)
                    .replace("data/tiny_corpus.txt", str(TINY_MEGATRON.parent / "data/tiny_corpus.txt")))
    assert "qwen3_moe" in path.read_text()
    return path


@pytest.fixture(scope="module")
def runs(torchrun, tmp_path_factory):
    import torch

    loss_recipe = _loss_recipe(tmp_path_factory.mktemp("loss"))
    moe_recipe = _moe_recipe(tmp_path_factory.mktemp("moe"))
    run = torchrun("recompute", "--recipe", str(TINY_MEGATRON), "--loss-recipe", str(loss_recipe),
                   "--moe-recipe", str(moe_recipe), script=SCRIPT)
    path = run.out / "recompute.pt"
    assert path.is_file(), run.tail()
    return torch.load(path), loss_recipe, moe_recipe


@pytest.fixture(scope="module")
def results(runs):
    return runs[0]["plans"]


def test_generated_recompute_fields_are_megatron_cores(results):
    assert results["none"]["megatron"]["recompute_granularity"] is None
    assert results["selective"]["megatron"] == dict(recompute_granularity="selective", recompute_method=None,
                                                    recompute_num_layers=None, recompute_modules=None)
    assert results["selective:mlp"]["megatron"]["recompute_modules"] == ["mlp"]
    assert results["full:block1"]["megatron"] == dict(recompute_granularity="full", recompute_method="block",
                                                      recompute_num_layers=1, recompute_modules=None)
    assert results["full"]["megatron"]["recompute_method"] == "uniform"


def test_recomputation_gives_the_gradients_of_none(results):
    import torch

    reference = results["none"]["grads"]
    assert sum(g.norm() for g in reference.values()) > 0  # a real backward, not an empty graph
    for name, result in results.items():
        assert result["grads"].keys() == reference.keys()
        for key, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference[key], rtol=0, atol=0, msg=f"{name}: {key}")


def _predicted(overrides: dict) -> int:
    from toolkit.estimate.memory import estimate_memory
    from toolkit.planner.recipe import recipe_plan
    from toolkit.spec.recipe import load_recipe, recipe_model

    recipe = load_recipe(TINY_MEGATRON)
    model = recipe_model(recipe)
    plan = recipe_plan(recipe, model, **overrides)
    assert plan.transformer_impl == "local"
    return estimate_memory(model, plan).activations


@pytest.mark.parametrize("name", ["none", "selective", "selective:mlp", "full:block1"])
def test_activation_estimate_within_3_percent_of_what_megatron_core_keeps(results, name):
    """Full recomputation is left out: its estimate is the backward peak (one block recomputed), which a forward's
    saved tensors do not show."""
    from mcore_recompute import PLANS

    assert _predicted(PLANS[name]) == pytest.approx(results[name]["saved_bytes"], rel=0.03)


def test_bf16_estimate_counts_the_softmax_copy(runs):
    from mcore_recompute import BF16

    measured = runs[0]["bf16_none_saved_bytes"]
    assert _predicted(BF16) == pytest.approx(measured, rel=0.03)


def test_recomputation_keeps_less_for_backward(results):
    saved = {name: result["saved_bytes"] for name, result in results.items()}
    assert saved["none"] > saved["selective"] > saved["selective:mlp"]
    assert saved["none"] > saved["full:block1"] > saved["full"]


def test_block_method_checkpoints_the_first_layer_of_the_chunk_only(results):
    """Two identical layers: recomputing one of them saves half of what recomputing both saves."""
    saved = {name: result["saved_bytes"] for name, result in results.items()}
    one = saved["none"] - saved["full:block1"]
    both = saved["none"] - saved["full"]
    assert one == pytest.approx(both / 2, rel=0.02)


def test_the_loss_peak_is_the_fp32_softmax_and_a_bf16_copy_as_the_estimate_counts(runs):
    """Megatron-Core's vocab-parallel cross-entropy turns its fp32 copy of the logits into the softmax and then the
    gradient in place; beside it only the bf16 logits (forward) or their gradient (backward): 1.5 fp32 logits over
    what the layers keep, where the estimate used to count two on top of the layers' peak (the HF loss's terms)."""
    from mcore_recompute import LOSS_PEAK, LOSS_VOCAB

    from toolkit.estimate.memory import estimate_memory, loss_peak_bytes
    from toolkit.planner.recipe import recipe_plan
    from toolkit.spec.recipe import load_recipe, recipe_model

    measured, at = runs[0]["loss_peak"]
    recipe = load_recipe(runs[1])
    model = recipe_model(recipe)
    assert model.vocab_size == LOSS_VOCAB
    plan = recipe_plan(recipe, model, **LOSS_PEAK)
    assert loss_peak_bytes(model, plan) == pytest.approx(measured, rel=0.03), at
    logits = 4 * LOSS_VOCAB * plan.micro_batch * plan.seq_len
    assert 1.45 * logits < measured < 1.7 * logits  # the loss's, not the layers' (hidden 64): 1.5 logits and a little
    memory = estimate_memory(model, plan)
    assert "logits_grad" not in memory.overhead_detail and "head_backward" in memory.overhead_detail


def _moe_estimate(runs, name: str, imbalance: float):
    from mcore_recompute import MOE_PLANS

    from toolkit.estimate.memory import estimate_memory, stage_params
    from toolkit.estimate.params import count_params
    from toolkit.planner.recipe import recipe_plan
    from toolkit.spec.recipe import load_recipe, recipe_model

    recipe = load_recipe(runs[2])
    model = recipe_model(recipe)
    plan = recipe_plan(recipe, model, **MOE_PLANS[name], moe_imbalance=imbalance)
    return model, plan, estimate_memory(model, plan), stage_params(model, count_params(model), plan, 0)


@pytest.mark.parametrize("name", ["ep2", "folded"])
def test_moe_experts_split_over_ep_as_the_estimate_counts(runs, name):
    """At EP 2 each rank holds half the routed experts (and every dense parameter; folded over TP 2, half of each
    attention and embedding matrix too): what the estimate's weights, fp32 main grads and distributed-optimizer
    shards are counted from."""
    from toolkit.estimate.params import count_params

    ranks = runs[0]["moe"][name]
    model, plan, memory, params = _moe_estimate(runs, name, 1.0)
    assert plan.ep == 2 and plan.expert_dp == 1 and plan.tp == (2 if name == "folded" else 1)
    for rank in ranks:
        assert rank["params"]["expert"] == params.expert > 0
        assert rank["params"]["dense"] == params.dense
        assert rank["grad_elements"] == params.total  # one fp32 main grad per parameter held
    assert memory.weights == params.total * 4 and memory.gradients == params.total * 4
    experts = sum(layer.experts for layer in count_params(model).layers)
    assert 2 * ranks[0]["params"]["expert"] == experts  # split, not replicated


@pytest.mark.parametrize("name", ["ep2", "folded"])
def test_moe_activations_within_5_percent_of_what_each_ep_rank_keeps(runs, name):
    """Each rank's kept bytes against the estimate at the routing imbalance that rank saw (its received routed
    tokens over k x the tokens it routes; the estimate caps nothing at EP 2 below 2): the router, the permutation
    and the routed experts' activations, tensor by tensor; folded over TP 2, the attention's split activations and
    the sequence-parallel parts (each rank routes its half of the sequence). The busiest rank is the one the
    estimate's default stands for."""
    ranks = runs[0]["moe"][name]
    model = _moe_estimate(runs, name, 1.0)[0]
    factors = [sum(r["received"]) / (len(r["received"]) * r["tokens"] * model.experts_top_k) for r in ranks]
    assert all(len(r["received"]) == model.num_moe_layers for r in ranks)
    copies = model.experts_top_k * ranks[0]["tokens"] * model.num_moe_layers
    assert sum(sum(r["received"]) for r in ranks) == len(ranks) * copies  # dropless: every copy lands somewhere
    for rank, factor in zip(ranks, factors):
        estimated = _moe_estimate(runs, name, max(1.0, factor))[2].activations
        assert estimated == pytest.approx(rank["saved_bytes"], rel=0.05), (factor, estimated, rank["saved_bytes"])
    busiest = max(range(len(ranks)), key=lambda i: factors[i])
    assert ranks[busiest]["saved_bytes"] >= min(r["saved_bytes"] for r in ranks)
