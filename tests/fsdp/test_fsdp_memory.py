"""The FSDP2 memory model against a real run: what each of the 2 CPU ranks held while training the tiny recipe with
Accelerate's FSDP2 (parameter shards, gradient shards, optimizer states, read from the live DTensors and the
optimizer by the post-preparation check into sharding.json) against `dmt estimate --backend fsdp --json`'s
memory_bytes.weights / gradients / optimizer for the same model and plan: each within 5%.

Measured (158,016 parameters, dp_shard 2): weights 316,032 B per rank estimated and held, gradients 316,032 and
316,032, optimizer 632,064 estimated against 632,148 held (AdamW's 21 fp32 `step` scalars): 0.00%, 0.00%, 0.01%."""

import json

import pytest
from fsdp_helpers import TINY_FSDP

from toolkit.backends.fsdp.train import SHARDING_FILE

pytestmark = pytest.mark.launch
HELD = {"weights": "local_bytes", "gradients": "gradient_bytes", "optimizer": "optimizer_bytes"}


def test_estimate_matches_the_bytes_each_rank_held(accelerate_run, tmp_path, capsys):
    from toolkit.cli.main import main
    from toolkit.spec.recipe import load_recipe

    recipe = load_recipe(TINY_FSDP)
    model = tmp_path / "config.json"
    model.write_text(json.dumps(recipe.model.config))
    capsys.readouterr()
    assert main(["estimate", "--model", str(model), "--gpus", "2", "--backend", "fsdp",
                 "--micro-batch", str(recipe.plan.micro_batch), "--seq-len", str(recipe.training.seq_len),
                 "--global-batch", str(recipe.training.global_batch), "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["plan"]["dp_shard"] == 2
    record = json.loads((accelerate_run.out / SHARDING_FILE).read_text())
    for rank in record["ranks"]:
        for component, field in HELD.items():
            predicted = estimate["memory_bytes"][component]
            assert predicted == pytest.approx(rank[field], rel=0.05), (component, predicted, rank[field])
