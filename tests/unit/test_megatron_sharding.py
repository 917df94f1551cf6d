"""Which format a Megatron-Core checkpoint's distributed optimizer state is loaded in (the one its manifest records),
and the one-line refusal of a background save's dp_reshardable state at another model-parallel layout."""

from pathlib import Path

import pytest

from toolkit.backends.megatron.checkpoint import (
    ASYNC_SHARDING,
    MODEL_PARALLEL_KEYS,
    SYNC_SHARDING,
    check_expert_resharding,
    layout,
    optimizer_sharding,
)
from toolkit.errors import UserInputError
from toolkit.spec.plan import Plan

SAVED = Plan(backend="megatron", gpus=2, zero=0, dp=2, tp=1, pp=1, distributed_optimizer=True, micro_batch=1,
             grad_accum=4, global_batch=8)


def manifest(sharding: str | None) -> dict:
    return {"layout": layout(SAVED), **({"optimizer_sharding": sharding} if sharding else {})}


def test_a_checkpoint_loads_in_the_format_it_was_saved_in():
    assert optimizer_sharding(manifest(ASYNC_SHARDING), Path("checkpoint-4"), SAVED) == "dp_reshardable"
    assert optimizer_sharding(manifest(SYNC_SHARDING), Path("checkpoint-4"), SAVED) == "fully_reshardable"
    # saved before the manifest recorded it: the only format then
    assert optimizer_sharding(manifest(None), Path("checkpoint-4"), SAVED) == "fully_reshardable"


def test_a_background_save_reshards_in_data_parallelism_only():
    fewer_ranks = SAVED.model_copy(update={"dp": 1, "grad_accum": 8})
    assert optimizer_sharding(manifest(ASYNC_SHARDING), Path("checkpoint-4"), fewer_ranks) == "dp_reshardable"
    tp2 = SAVED.model_copy(update={"dp": 1, "tp": 2, "grad_accum": 8})
    with pytest.raises(UserInputError) as refused:
        optimizer_sharding(manifest(ASYNC_SHARDING), Path("checkpoint-4"), tp2)
    message = str(refused.value)
    assert "--resume" in message and "checkpoint-4" in message and "tp 1 -> 2" in message
    assert "training.async_save: false" in message and "\n" not in message
    # a synchronous save's state moves to any layout; so does a plain optimizer's (no distributed buffers)
    assert optimizer_sharding(manifest(SYNC_SHARDING), Path("checkpoint-4"), tp2) == "fully_reshardable"
    plain = tp2.model_copy(update={"distributed_optimizer": False})
    assert optimizer_sharding(manifest(ASYNC_SHARDING), Path("checkpoint-4"), plain) == "dp_reshardable"
    assert set(MODEL_PARALLEL_KEYS) <= set(layout(SAVED))


def test_expert_optimizer_state_moves_between_ep_sizes_above_one_only():
    """At EP > 1 Megatron-Core 0.16.1 chains a separate optimizer for the experts, at EP 1 it has one: a checkpoint
    saved at EP 2 resumes at EP 4 (or EP 2 at another data-parallel size), not at EP 1, refused in one line."""
    ep2 = SAVED.model_copy(update={"ep": 2})
    saved = {"layout": layout(ep2)}
    check_expert_resharding(saved, Path("checkpoint-4"), SAVED.model_copy(update={"ep": 4, "gpus": 4, "dp": 4}))
    check_expert_resharding(saved, Path("checkpoint-4"), ep2)
    for other, resumed in ((saved, SAVED), ({"layout": layout(SAVED)}, ep2)):
        with pytest.raises(UserInputError) as refused:
            check_expert_resharding(other, Path("checkpoint-4"), resumed)
        assert refused.value.key == "--resume" and "checkpoint-4" in str(refused.value)
        assert "EP > 1" in str(refused.value) and "\n" not in str(refused.value)
