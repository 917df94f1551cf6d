"""Recipes generate files that agree with each other and pass the validator; broken configs each get their message."""

import json
from pathlib import Path

import pytest
import yaml

from toolkit.cli.main import main
from toolkit.generate.examples import render_examples

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
BROKEN = Path(__file__).resolve().parent / "broken_configs"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_generates_consistent_files(recipe, tmp_path, capsys):
    out = tmp_path / "gen"
    assert main(["generate", str(recipe), "--out", str(out), "--json"]) == 0
    plan = json.loads((out / "plan.json").read_text())["plan"]
    if plan["backend"] != "deepspeed":
        assert not (out / "deepspeed.json").exists()
        return
    ds = json.loads((out / "deepspeed.json").read_text())
    trainer = json.loads((out / "trainer_args.json").read_text())
    accelerate = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert ds["train_batch_size"] == plan["global_batch"] == plan["micro_batch"] * plan["grad_accum"] * plan["dp"]
    assert ds["train_micro_batch_size_per_gpu"] == trainer["per_device_train_batch_size"] == plan["micro_batch"]
    assert ds["gradient_accumulation_steps"] == trainer["gradient_accumulation_steps"] == plan["grad_accum"]
    assert ds["zero_optimization"]["stage"] == plan["zero"]
    assert accelerate["num_processes"] == plan["gpus"] and "mixed_precision" not in accelerate
    assert accelerate["deepspeed_config"]["deepspeed_config_file"] == str(out / "deepspeed.json")
    assert (out / "launch.sh").stat().st_mode & 0o111
    capsys.readouterr()
    assert main(["validate", str(out / "deepspeed.json"), "--world-size", str(plan["gpus"]),
                 "--trainer-args", str(out / "trainer_args.json")]) == 0


def test_committed_deepspeed_examples_have_not_drifted():
    rendered = render_examples()
    committed = {p.name for p in (ROOT / "deepspeed_configs").glob("*.json")}
    assert committed == set(rendered)
    for name, text in rendered.items():
        assert (ROOT / "deepspeed_configs" / name).read_text() == text, f"{name} drifted: run python -m toolkit.generate.examples"


@pytest.mark.parametrize("name", sorted(rendered for rendered in render_examples()))
def test_committed_examples_validate_with_the_memory_estimate(name, capsys):
    assert main(["validate", str(ROOT / "deepspeed_configs" / name), "--world-size", "8", "--model", "llama-3.1-8b",
                 "--seq-len", "4096", "--recompute", "full", "--json"]) in (0, 2)
    report = json.loads(capsys.readouterr().out)
    # every example is structurally valid; only the memory estimate may object (zero0 does not fit 8B on 80 GB)
    assert all(p["key"] == "memory" for p in report["problems"]), report
    assert report["ok"] == (name != "zero0-bf16.json")


EXPECTED = json.loads((BROKEN / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_broken_config_gets_its_own_message(name, capsys):
    assert main(["validate", str(BROKEN / f"{name}.json"), "--world-size", "2"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(str(BROKEN))]
    assert len(lines) == 1 and f": {EXPECTED[name]}:" in lines[0], lines


def test_messages_are_distinct_across_the_corpus(capsys):
    messages = set()
    for name in EXPECTED:
        main(["validate", str(BROKEN / f"{name}.json"), "--world-size", "2"])
        messages.add(capsys.readouterr().err.strip().splitlines()[-1].split(": ", 1)[1])
    assert len(messages) == len(EXPECTED)


def test_trainer_args_mismatches_are_all_listed(tmp_path, capsys):
    out = tmp_path / "gen"
    assert main(["generate", str(ROOT / "recipes/tiny-llama-cpu.yaml"), "--out", str(out)]) == 0
    trainer = json.loads((out / "trainer_args.json").read_text())
    trainer.update(learning_rate=1.0, per_device_train_batch_size=8, max_steps=99)
    (out / "trainer_args.json").write_text(json.dumps(trainer))
    capsys.readouterr()
    assert main(["validate", str(out / "deepspeed.json"), "--world-size", "2", "--trainer-args", str(out / "trainer_args.json")]) == 2
    err = capsys.readouterr().err
    for key in ("optimizer.params.lr", "train_micro_batch_size_per_gpu", "scheduler.params.total_num_steps"):
        assert key in err
