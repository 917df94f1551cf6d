"""`dmt restore-test --backend megatron`: the tiny Qwen3-MoE under Megatron-Core at EP 2 folded over TP 2 on 2 gloo
ranks (each rank holding half of the experts, and half of each attention weight), training on a prepared blend, SIGKILLed right after its dist checkpoint at step 3
(written in the background) is complete, resumed from it, continues exactly as the uninterrupted run, routing every
token to the same experts."""

import json
from pathlib import Path

import pytest
from megatron_helpers import TINY_MEGATRON, TINY_MOE

from toolkit.checkpoint.manifest import read_manifest
from toolkit.checkpoint.verify import verify
from toolkit.cli.main import main
from toolkit.runtime.metrics import read_metrics

pytestmark = pytest.mark.launch


# checkpoint-3 is written in the background (async_save): `latest` names it, and restore-test kills the run, only
# once every rank's write is done, a few tiny steps later (~2 s on 2 loaded cores): 12 steps leave room for that
STEPS = 12


def _on_a_blend(recipe: Path, directory: Path) -> Path:
    """The recipe training on the tiny corpus prepared by `dmt data prepare` (a blend of one prefix), read through
    Megatron-Core's GPTDataset by its data loader workers."""
    import yaml

    tokenizer = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
    corpus = TINY_MEGATRON.parent / "data" / "tiny_corpus.txt"
    assert main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(tokenizer), "--output-prefix",
                 str(directory / "tiny"), "--append-eod", "--workers", "1"]) == 0
    text = yaml.safe_load(recipe.read_text())
    text["data"] = {"blend": [{"prefix": str(directory / "tiny"), "weight": 1.0}], "split": "98,2,0",
                    "tokenizer": {"path": str(tokenizer)}}
    recipe.write_text(yaml.safe_dump(text, sort_keys=False))
    return recipe


# the experts' layout of the restore test: EP 2 folded over TP 2 (each rank holds half of the experts, whole at ETP 1,
# and half of every attention and dense weight, sequence parallel)
MOE_FLAGS = ("--tp", "2", "--ep", "2", "--etp", "1", "--sequence-parallel")


def test_megatron_restore_is_identical_to_the_bit(tmp_path, capsys, megatron_recipe, tmp_path_factory):
    """From a blend: the resumed MoE run reads on from the checkpoint's consumed samples and stays bitwise, its
    routing included (restore-test compares each step's tokens per expert too)."""
    recipe = _on_a_blend(megatron_recipe("tiny-moe-megatron-async", model={"config": TINY_MOE["qwen3_moe"]},
                                         training={"async_save": True}),  # saved in the background
                         tmp_path_factory.mktemp("prepared"))
    capsys.readouterr()
    code = main(["restore-test", "--recipe", str(recipe), "--backend", "megatron", *MOE_FLAGS, "--steps",
                 str(STEPS), "--save-at", "3", "--workdir", str(tmp_path), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["passed"] and result["identical"], result["mismatches"]
    assert result["reference_losses"] == result["resumed_losses"] and len(result["resumed_losses"]) == STEPS - 3
    assert result["killed_at_step"] is not None and result["killed_at_step"] < STEPS
    assert Path(result["checkpoint"]).name == "checkpoint-3"
    report = verify(Path(result["checkpoint"]))
    assert report.ok and report.format == "megatron-dist", report.problems
    reference = read_metrics(tmp_path / "reference")
    assert reference[-1]["step"] == STEPS
    resumed = read_metrics(tmp_path / "interrupted")
    assert [r["moe_tokens_per_expert"] for r in resumed] == [r["moe_tokens_per_expert"] for r in reference[3:]]
    layout = json.loads((tmp_path / "interrupted" / "moe_layout.json").read_text())
    assert [rank["layers"]["decoder.layers.0.mlp"]["experts"] for rank in layout["ranks"]] == [[0, 1], [2, 3]]
    assert [rank["tp_rank"] for rank in layout["ranks"]] == [0, 1]  # folded: the same 2 ranks are TP 2 too
    # the kill reached the ranks (torchrun puts them in sessions of their own): nothing trained on after it
    killed = [json.loads(line)["step"] for line in (tmp_path / "interrupted/killed.metrics.jsonl").read_text().splitlines()]
    assert max(killed) == result["killed_at_step"]


def test_zero_is_refused_for_megatron(capsys):
    code = main(["restore-test", "--recipe", str(TINY_MEGATRON), "--zero", "2"])
    assert code == 2 and "--zero" in capsys.readouterr().err


def test_megatron_restore_at_another_world_size_reports_the_drift(tmp_path, capsys, megatron_recipe):
    """Saved by 2 data-parallel ranks with the distributed optimizer, in the background (its state dp_reshardable),
    resumed by 1 (the dist checkpoint reshards in data parallelism, gradient accumulation doubles): the same samples
    per step, the loss within the stated tolerance, the drift reported."""
    recipe = megatron_recipe("tiny-megatron-distopt-async", plan={"distributed_optimizer": True},
                             training={"async_save": True})
    capsys.readouterr()
    code = main(["restore-test", "--recipe", str(recipe), "--steps", "6", "--save-at", "3",
                 "--resume-world-size", "1", "--workdir", str(tmp_path), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["passed"], result["mismatches"]
    assert result["tolerance"] == 1e-3 and result["max_abs_diff"] <= 1e-3
    assert len(result["resumed_losses"]) == 3 and all(loss is not None for loss in result["resumed_losses"])
    resumed_log = (tmp_path / "resumed.log").read_text()
    assert "layout changed" in resumed_log  # really resharded, not a same-layout reload
    assert read_manifest(Path(result["checkpoint"]))["optimizer_sharding"] == "dp_reshardable"




def test_a_resume_from_ep2_at_ep1_is_refused_before_anything_runs(tmp_path, capsys, megatron_recipe):
    """Megatron-Core 0.16.1 chains a separate expert optimizer only at EP > 1: a checkpoint saved at EP 2 does not
    load at EP 1 (measured: the chained optimizer keys are missing), so restore-test says so in one line at once
    (the 2 CPU ranks hold no other EP than 1 and 2; unit: tests/unit/test_megatron_sharding.py)."""
    recipe = megatron_recipe("tiny-moe-megatron", model={"config": TINY_MOE["qwen3_moe"]})
    capsys.readouterr()
    code = main(["restore-test", "--recipe", str(recipe), *MOE_FLAGS, "--resume-ep", "1", "--workdir",
                 str(tmp_path / "work")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--resume-ep" in err[0] and "EP > 1" in err[0], err
    assert not (tmp_path / "work" / "reference").exists()
