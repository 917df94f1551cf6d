"""Every recompute plan `dmt plan` can propose (none, selective core attention, selective MLP, the block method,
full) generates a megatron.yaml that real Megatron-Core builds and runs forward and backward on 2 gloo ranks, with
the gradients of no recomputation and less memory kept for backward, in the order the memory model predicts."""

from pathlib import Path

import pytest

from megatron_helpers import TINY_MEGATRON

pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).resolve().parent / "mcore_recompute.py"


@pytest.fixture(scope="module")
def runs(torchrun):
    import torch

    run = torchrun("recompute", "--recipe", str(TINY_MEGATRON), script=SCRIPT)
    path = run.out / "recompute.pt"
    assert path.is_file(), run.tail()
    return torch.load(path), TINY_MEGATRON


def test_generated_recompute_fields_are_megatron_cores(runs):
    results, _ = runs
    assert results["none"]["megatron"]["recompute_granularity"] is None
    assert results["selective"]["megatron"] == dict(recompute_granularity="selective", recompute_method=None,
                                                    recompute_num_layers=None, recompute_modules=None)
    assert results["selective:mlp"]["megatron"]["recompute_modules"] == ["mlp"]
    assert results["full:block1"]["megatron"] == dict(recompute_granularity="full", recompute_method="block",
                                                      recompute_num_layers=1, recompute_modules=None)
    assert results["full"]["megatron"]["recompute_method"] == "uniform"


def test_recomputation_gives_the_gradients_of_none(runs):
    import torch

    results, _ = runs
    reference = results["none"]["grads"]
    assert sum(g.norm() for g in reference.values()) > 0  # a real backward, not an empty graph
    for name, result in results.items():
        assert result["grads"].keys() == reference.keys()
        for key, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference[key], rtol=0, atol=0, msg=f"{name}: {key}")


def test_recomputation_keeps_less_for_backward_in_the_order_the_model_predicts(runs):
    from mcore_recompute import PLANS

    from toolkit.estimate.memory import estimate_memory
    from toolkit.spec.recipe import load_recipe, recipe_model, recipe_plan

    results, path = runs
    saved = {name: result["saved_bytes"] for name, result in results.items()}
    assert saved["none"] > saved["selective"] > saved["selective:mlp"]
    assert saved["none"] > saved["full:block1"] > saved["full"]
    recipe = load_recipe(path)
    model = recipe_model(recipe)
    predicted = {name: estimate_memory(model, recipe_plan(recipe, model, **PLANS[name])).activations
                 for name in ("none", "selective", "selective:mlp", "full:block1")}
    assert predicted["none"] > predicted["selective"] > predicted["selective:mlp"]
    assert predicted["none"] > predicted["full:block1"]


def test_block_method_checkpoints_the_first_layer_of_the_chunk_only(runs):
    """Two identical layers: recomputing one of them saves half of what recomputing both saves."""
    results, _ = runs
    saved = {name: result["saved_bytes"] for name, result in results.items()}
    one = saved["none"] - saved["full:block1"]
    both = saved["none"] - saved["full"]
    assert one == pytest.approx(both / 2, rel=0.02)
