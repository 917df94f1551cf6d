"""The contract of `dmt plan`: the `plan` object of every ranked plan, pasted as a recipe's `plan:` section (less what
a recipe keeps under `cluster:` and `training:`, and the derived dp / grad_accum), is accepted; `dmt generate` writes
its files, which `dmt validate` (and, for Megatron-LM's flags, its recorded parser) accepts; and the recipe's
plan.json, like `dmt estimate` with the same options, predicts the same memory and step time."""

import json

import pytest
import yaml

from helpers import TINY
from megatron_lm_args import problems as megatron_lm_problems
from toolkit.cli.main import main
from toolkit.cli.options import option_argv
from toolkit.spec.options import OPTION_NAMES, recipe_key

# dense, GQA and MoE models, one GPU to 1024; each backend's best plans
CASES = [("llama-3.2-1b", 1, 2048, 8), ("llama-3.1-8b", 8, 4096, 64), ("llama-3.1-70b", 64, 8192, 256),
         ("mixtral-8x7b", 16, 4096, 64), ("qwen2.5-7b", 1024, 4096, 2048)]
DERIVED = ("dp", "grad_accum")


def _json(capsys, *argv):
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def recipe_from_record(record: dict, model: str) -> dict:
    """A recipe whose plan section is the ranked plan's, with the sizes a recipe keeps elsewhere where they go."""
    plan = dict(record["plan"])
    cluster = {"gpus": plan.pop("gpus"), "gpu": record["gpu"]}
    # gpus_per_node, nvlink_domain, network: the cluster's shape
    cluster.update({recipe_key(name).split(".", 1)[1]: plan.pop(name) for name in list(plan)
                    if name in OPTION_NAMES and recipe_key(name).startswith("cluster.")})
    training = {"seq_len": plan.pop("seq_len"), "global_batch": plan.pop("global_batch"), "max_steps": 100,
                "learning_rate": 3e-4}
    for name in DERIVED:
        plan.pop(name)
    finetune = plan.pop("finetune")  # the recipe's own section
    assert all(recipe_key(name) == f"plan.{name}" for name in plan)  # nothing else lives outside `plan:`
    return {"name": "ranked", "model": {"source": model},
            "data": {"train_files": [str(TINY.parent / "data" / "tiny_corpus.txt")]},
            "cluster": cluster, "training": training, "plan": plan, "finetune": finetune}


@pytest.mark.parametrize("backend", ["deepspeed", "megatron", "fsdp"])
@pytest.mark.parametrize("model, gpus, seq, batch", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_ranked_plan_generates_validates_and_estimates_the_same(tmp_path, capsys, model, gpus, seq, batch,
                                                                      backend):
    ranked = _json(capsys, "plan", "--model", model, "--gpus", str(gpus), "--seq-len", str(seq), "--global-batch",
                   str(batch), "--backend", backend, "--top", "3")["plans"]
    assert ranked or backend == "megatron" and gpus == 1, "the search found nothing"
    for index, record in enumerate(ranked):
        recipe = tmp_path / f"recipe-{index}.yaml"
        recipe.write_text(yaml.safe_dump(recipe_from_record(record, model)))
        out = tmp_path / f"gen-{index}"
        assert main(["generate", str(recipe), "--out", str(out)]) == 0, capsys.readouterr().err
        capsys.readouterr()
        written = json.loads((out / "plan.json").read_text())
        assert written["plan"] == record["plan"]
        assert (written["memory_bytes"], written["step_time_s"]) == (record["memory_bytes"], record["step_time_s"])
        options = {k: v for k, v in record["plan"].items() if k not in ("gpus", *DERIVED)}
        estimate = _json(capsys, "estimate", "--model", model, "--gpus", str(gpus), *option_argv(options))
        assert (estimate["memory_bytes"], estimate["step_time_s"]) == (record["memory_bytes"], record["step_time_s"])
        if backend != "megatron":
            first = out / ("deepspeed.json" if backend == "deepspeed" else "accelerate.yaml")
            argv = ["validate", str(first), "--world-size", str(gpus), "--trainer-args", str(out / "trainer_args.json")]
        else:
            argv = ["validate", str(out / "megatron.yaml"), "--world-size", str(gpus)]
            assert megatron_lm_problems((out / "megatron_args.txt").read_text()) == []
            if record["plan"]["tp"] > 1 or record["plan"]["cp"] > 1:  # Megatron-LM's validate_args asserts it
                assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in (out / "launch.sh").read_text()
                assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in (out / "slurm.sbatch").read_text()
        assert main(argv) == 0, capsys.readouterr()
        capsys.readouterr()


def _is_folded(plan: dict) -> bool:
    """Megatron-Core's parallel folding: the experts' TP differs from attention's, or EP reaches beyond DP x CP."""
    return plan.get("etp") not in (None, plan["tp"]) or plan["ep"] > plan["dp"] * plan["cp"]


def test_moe_search_ranks_folded_layouts_beside_unfolded_ones():
    from toolkit.estimate.comm import Network
    from toolkit.planner.search import search
    from toolkit.spec.cluster import get_gpu
    from toolkit.spec.model import load_model_spec

    gpu = get_gpu("h100-80gb")
    ranked = search(load_model_spec("qwen3-30b-a3b"), 64, gpu, Network.from_catalogue(gpu, 8), ("megatron",),
                    seq_len=4096, global_batch=256).ranked
    plans = [c.plan.as_dict() for c in ranked]
    folded = [p for p in plans if _is_folded(p)]
    assert folded and len(folded) < len(plans)
    assert any(p.get("etp") == 1 and p["tp"] > 1 for p in folded)  # expert TP 1 under attention TP
    assert any(p["ep"] > p["dp"] * p["cp"] for p in folded)  # EP over ranks attention spends on TP / PP
    times = [c.time.total_s for c in ranked]
    assert times == sorted(times)  # one ranking, folded and unfolded together


def test_folded_ranked_plans_generate_and_validate(tmp_path, capsys):
    """Ranked plans with the experts folded (ETP 1 under TP 2) paste into recipes, generate, and pass dmt validate
    (Megatron-Core's TransformerConfig) and Megatron-LM's parser table, with --expert-tensor-parallel-size 1."""
    ranked = _json(capsys, "plan", "--model", "qwen3-30b-a3b", "--gpus", "64", "--seq-len", "4096",
                   "--global-batch", "256", "--backend", "megatron", "--tp", "2", "--etp", "1", "--top", "2")["plans"]
    assert ranked
    for index, record in enumerate(ranked):
        assert record["plan"]["etp"] == 1 and record["plan"]["ep"] > 1
        recipe = tmp_path / f"recipe-{index}.yaml"
        recipe.write_text(yaml.safe_dump(recipe_from_record(record, "qwen3-30b-a3b")))
        out = tmp_path / f"gen-{index}"
        assert main(["generate", str(recipe), "--out", str(out)]) == 0, capsys.readouterr().err
        capsys.readouterr()
        assert json.loads((out / "plan.json").read_text())["plan"] == record["plan"]
        args = (out / "megatron_args.txt").read_text()
        assert "--expert-tensor-parallel-size 1" in args.splitlines() and megatron_lm_problems(args) == []
        assert main(["validate", str(out / "megatron.yaml"), "--world-size", "64"]) == 0, capsys.readouterr()
        capsys.readouterr()
