"""The memory model's `weights` and `optimizer` against what real 2-rank DeepSpeed ZeRO 1/2/3 runs hold per rank."""

import json

import pytest

from toolkit.estimate.memory import estimate_memory
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

pytestmark = pytest.mark.distributed

RUNS = {"zero1-tied": 1, "zero2": 2, "zero3": 3}


@pytest.mark.parametrize("run", RUNS)
def test_weights_and_optimizer_bytes_within_5_percent_of_deepspeed(zero_checkpoints, run):
    ckpt = zero_checkpoints[run]
    model = load_model_spec(str(ckpt / "config.json"))
    plan = resolve_plan(model, 2, backend="deepspeed", zero=RUNS[run], micro_batch=2, seq_len=32, precision="bf16")
    estimate = estimate_memory(model, plan)
    for rank in (0, 1):
        measured = json.loads((ckpt / f"model_states_rank{rank}.json").read_text())
        assert measured["stage"] == RUNS[run] and measured["world_size"] == 2
        assert estimate.params_on_gpu == measured["num_params"]
        assert estimate.optimizer == pytest.approx(measured["optimizer_bytes"], rel=0.05)
        assert estimate.weights == pytest.approx(measured["weights_bytes"], rel=0.05)


def test_zero3_halves_weights_and_every_stage_halves_the_optimizer(zero_checkpoints):
    per_stage = {run: json.loads((zero_checkpoints[run] / "model_states_rank0.json").read_text()) for run in RUNS}
    params = per_stage["zero2"]["num_params"]
    assert per_stage["zero3"]["weights_bytes"] * 2 == pytest.approx(per_stage["zero2"]["weights_bytes"], rel=0.01)
    for stats in per_stage.values():  # fp32 master + 2 Adam moments = 12 bytes/param, split over 2 ranks
        assert stats["optimizer_bytes"] == pytest.approx(12 * stats["num_params"] / 2, rel=0.01)
    assert params > 0
