"""The plans `dmt plan` ranks launch for real: on a tiny 4-layer model and 2 CPU ranks, one plan for every value of
every option the search varies, per backend (ZeRO stage, offload, recomputation, TP, PP, VPP, sequence parallelism,
the distributed optimizer, FSDP2's shard group and resharding), each pasted into a recipe, generated, and trained for
two steps through the generated launch.sh."""

import itertools
import json

import pytest
import yaml

from helpers import TINY
from toolkit.backends.fsdp.train import SHARDING_FILE
from toolkit.checkpoint.manifest import resolve_latest
from toolkit.checkpoint.verify import verify
from toolkit.cli.main import main
from toolkit.runtime.metrics import read_metrics
from toolkit.spec.options import OPTION_NAMES, recipe_key

pytestmark = pytest.mark.launch
VARIED = ("backend", "zero", "offload_optimizer", "offload_params", "recompute", "recompute_modules",
          "recompute_num_layers", "tp", "pp", "vpp", "sequence_parallel", "distributed_optimizer", "dp_shard",
          "dp_replicate", "reshard_after_forward")
SEARCH = ["--gpus", "2", "--gpus-per-node", "2", "--seq-len", "64", "--global-batch", "8", "--precision", "fp32",
          "--transformer-impl", "local", "--top", "1000"]
# the search tries offload and recomputation only where a plan would not fit: pinned here so they are covered too
PINS = [[], ["--offload-optimizer", "cpu"], ["--zero", "3", "--offload-params", "cpu", "--offload-optimizer", "cpu"],
        ["--recompute", "full"], ["--backend", "megatron", "--recompute", "selective", "--recompute-modules", "mlp"],
        ["--backend", "megatron", "--recompute", "full", "--recompute-num-layers", "1"]]


def _cover(records: list[dict]) -> list[dict]:
    """The fewest plans that between them show every value the search gave every varied option, per backend (ZeRO-0
    and TP 2 of DeepSpeed are not those of Megatron-Core): each launch costs ~10 s, so the smallest cover, found
    exactly (a backend has at most a few dozen distinct plans and needs 2-4), not greedily (one launch more)."""
    values = lambda r: frozenset((r["plan"]["backend"], k, json.dumps(r["plan"][k])) for k in VARIED)  # noqa
    chosen = []
    for backend in sorted({r["plan"]["backend"] for r in records}):
        distinct = list({values(r): r for r in records if r["plan"]["backend"] == backend}.items())
        wanted = frozenset().union(*(v for v, _ in distinct))
        cover = next(combo for size in range(1, len(distinct) + 1) for combo in itertools.combinations(distinct, size)
                     if frozenset().union(*(v for v, _ in combo)) == wanted)
        chosen += [record for _, record in cover]
    return chosen


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """The tiny recipe with 4 layers (so that PP 2 x VPP 2 splits), 2 steps, and its config.json for dmt plan."""
    directory = tmp_path_factory.mktemp("tiny4")
    recipe = yaml.safe_load(TINY.read_text())
    recipe["model"]["config"]["num_hidden_layers"] = 4
    recipe["data"]["train_files"] = [str(TINY.parent / f) for f in recipe["data"]["train_files"]]
    recipe["training"].update(global_batch=8, max_steps=2, save_steps=2, warmup_steps=1)
    (directory / "config.json").write_text(json.dumps(recipe["model"]["config"]))
    return directory, recipe


def _ranked(capsys, config, pins) -> list[dict]:
    assert main(["plan", "--model", str(config), *SEARCH, *pins, "--json"]) in (0, 1), capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["plans"]


def test_one_plan_per_searched_option_value_trains_two_steps(tiny4, launch, capsys):
    directory, base = tiny4
    records = [record for pins in PINS for record in _ranked(capsys, directory / "config.json", pins)]
    chosen = _cover(records)
    assert {r["plan"]["backend"] for r in chosen} == {"deepspeed", "megatron", "fsdp"}
    failures = []
    for index, record in enumerate(chosen):
        # the options a recipe keeps under `plan:`; the cluster's and training's sizes stay the base recipe's, and
        # what the plan derives (gpus, dp, grad_accum) is derived again
        plan = {k: v for k, v in record["plan"].items() if k in OPTION_NAMES and recipe_key(k) == f"plan.{k}"}
        recipe = directory / f"plan-{index}.yaml"
        recipe.write_text(yaml.safe_dump({**base, "name": f"plan-{index}", "plan": plan}, sort_keys=False))
        config = directory / f"gen-{index}"
        assert main(["generate", str(recipe), "--out", str(config)]) == 0, capsys.readouterr().err
        capsys.readouterr()
        run = launch(f"ranked-{index}", "launch.sh", recipe, "torchrun", config_dir=config)
        steps = [r["step"] for r in read_metrics(run.out)]
        latest = resolve_latest(run.out)
        if steps != [1, 2] or latest is None or not verify(latest).ok or run.rc != 0:
            failures.append(f"{json.dumps(plan)}: steps {steps}, rc {run.rc}\n{run.tail(25)}")
        elif plan["backend"] == "fsdp":  # what fully_shard was given, read from the prepared model on every rank
            policies = {r["offload_policy"] for r in json.loads((run.out / SHARDING_FILE).read_text())["ranks"]}
            if policies != {"CPUOffloadPolicy" if plan["offload_params"] == "cpu" else "OffloadPolicy"}:
                failures.append(f"{json.dumps(plan)}: FSDP2 offload policies {policies}")
    assert not failures, "\n\n".join(failures)
