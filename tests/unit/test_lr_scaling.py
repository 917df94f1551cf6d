"""training.lr_scaling: the learning rate and warm-up follow the global batch into every backend's generated files,
plan.json records the rule and the numbers, and a directory whose files disagree is refused."""

import json

import pytest
import yaml

from helpers import ROOT
from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.validate.generated import read_generated

# the tiny CPU recipes of each backend: global batch 16, learning rate 5e-3, 3 warm-up steps (recipes/)
RECIPES = {"deepspeed": "tiny-llama-cpu.yaml", "fsdp": "tiny-llama-fsdp-cpu.yaml",
           "megatron": "tiny-llama-megatron-cpu.yaml"}


def _generate(tmp_path, backend: str, **training):
    recipe = yaml.safe_load((ROOT / "recipes" / RECIPES[backend]).read_text())
    recipe["training"].update(training)
    for key in ("train_files", "eval_files"):  # the recipe's data, from its own directory
        if key in recipe.get("data", {}):
            recipe["data"][key] = [str(ROOT / "recipes" / f) for f in recipe["data"][key]]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    assert main(["generate", str(path), "--out", str(out)]) == 0
    return recipe, out


def _rates(out, backend: str) -> dict:
    """The learning rate and warm-up each generated file trains with."""
    if backend == "megatron":
        config = yaml.safe_load((out / "megatron.yaml").read_text())
        args = (out / "megatron_args.txt").read_text().splitlines()
        lr = config["optimizer_config"]["lr"]
        assert config["scheduler"]["max_lr"] == lr and f"--lr {lr}" in args
        return {"lr": lr, "warmup": config["scheduler"]["lr_warmup_steps"]}
    trainer = json.loads((out / "trainer_args.json").read_text())
    rates = {"lr": trainer["learning_rate"], "warmup": trainer["warmup_steps"]}
    if backend == "deepspeed":
        ds = json.loads((out / "deepspeed.json").read_text())
        # cosine: WarmupCosineLR warms up to the optimizer's rate
        assert ds["optimizer"]["params"]["lr"] == ds["scheduler"]["params"].get("warmup_max_lr", rates["lr"])
        assert ds["optimizer"]["params"]["lr"] == rates["lr"]
        assert ds["scheduler"]["params"]["warmup_num_steps"] == rates["warmup"]
    return rates


@pytest.mark.parametrize("backend, rule, reference, lr, warmup", [
    ("deepspeed", "linear", 8, 0.01, 2),  # twice the batch: twice the rate, the same 24 warm-up samples, 2 steps
    ("fsdp", "sqrt", 64, 0.0025, 12),  # a quarter of the batch: half the rate, four times the warm-up steps
    ("megatron", "sqrt", 64, 0.0025, 12),
    ("megatron", "linear", 8, 0.01, 2),
])
def test_the_scaled_rate_and_warmup_reach_every_generated_file(tmp_path, backend, rule, reference, lr, warmup):
    recipe, out = _generate(tmp_path, backend, lr_scaling=rule, lr_reference_batch=reference)
    assert recipe["training"]["global_batch"] == 16 and recipe["training"]["learning_rate"] == 0.005
    assert _rates(out, backend) == {"lr": pytest.approx(lr), "warmup": warmup}
    record = json.loads((out / "plan.json").read_text())["lr_scaling"]
    assert record["rule"] == rule and record["reference_batch"] == reference and record["global_batch"] == 16
    assert record["learning_rate"] == pytest.approx(lr) and record["warmup_steps"] == warmup
    assert json.loads((out / "plan.json").read_text())["recipe_settings"]["training"]["learning_rate"] == 0.005
    read_generated(out / "plan.json")  # training reads the directory back: rule, record and files agree


def test_a_batch_at_its_reference_scales_nothing(tmp_path):
    _, out = _generate(tmp_path, "deepspeed", lr_scaling="linear", lr_reference_batch=16)
    assert "lr_scaling" not in json.loads((out / "plan.json").read_text())
    assert _rates(out, "deepspeed")["lr"] == 0.005


def test_a_file_edited_to_another_rate_is_refused(tmp_path):
    _, out = _generate(tmp_path, "megatron", lr_scaling="linear", lr_reference_batch=8)
    config = yaml.safe_load((out / "megatron.yaml").read_text())
    config["optimizer_config"]["lr"] = 0.005  # the recipe's unscaled rate
    (out / "megatron.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(UserInputError) as error:
        read_generated(out / "plan.json")
    assert "optimizer_config.lr" in error.value.key and "0.01" in error.value.message


def test_a_rule_without_its_reference_batch_is_one_line(tmp_path, capsys):
    recipe = yaml.safe_load((ROOT / "recipes" / RECIPES["deepspeed"]).read_text())
    recipe["training"]["lr_scaling"] = "sqrt"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert main(["generate", str(path), "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "training" in lines[0] and "lr_reference_batch" in lines[0], lines


def _edit_json(path, keys, value):
    data = json.loads(path.read_text())
    node = data
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    path.write_text(json.dumps(data))


def _edit_yaml(path, keys, value):
    data = yaml.safe_load(path.read_text())
    data[keys[0]][keys[1]] = value
    path.write_text(yaml.safe_dump(data))


def _edit_args(path, flag, value):
    lines = [f"{flag} {value}" if line.startswith(f"{flag} ") else line for line in path.read_text().splitlines()]
    path.write_text("\n".join(lines) + "\n")


# each launcher's learning rate and warm-up, edited away from plan.json's lr_scaling (linear from batch 8: 0.01, 2)
EDITS = {
    "deepspeed": [("trainer_args.json", lambda p: _edit_json(p, ["warmup_steps"], 3), "trainer_args.json warmup_steps"),
                  ("deepspeed.json", lambda p: _edit_json(p, ["scheduler", "params", "warmup_num_steps"], 3),
                   "DeepSpeed config scheduler.params.warmup_num_steps"),
                  ("deepspeed.json", lambda p: _edit_json(p, ["optimizer", "params", "lr"], 0.005),
                   "DeepSpeed config optimizer.params.lr")],
    "fsdp": [("trainer_args.json", lambda p: _edit_json(p, ["learning_rate"], 0.005), "trainer_args.json learning_rate"),
             ("trainer_args.json", lambda p: _edit_json(p, ["warmup_steps"], 3), "trainer_args.json warmup_steps")],
    "megatron": [("megatron.yaml", lambda p: _edit_yaml(p, ["scheduler", "lr_warmup_steps"], 3),
                  "megatron.yaml scheduler.lr_warmup_steps"),
                 ("megatron_args.txt", lambda p: _edit_args(p, "--lr", 0.005), "megatron_args.txt --lr"),
                 ("megatron_args.txt", lambda p: _edit_args(p, "--lr-warmup-iters", 3),
                  "megatron_args.txt --lr-warmup-iters")],
}


@pytest.mark.parametrize("backend", sorted(EDITS))
def test_dmt_validate_checks_every_launchers_rate_and_warmup(tmp_path, capsys, backend):
    """`dmt validate DIR`: the generated files agree with plan.json's lr_scaling; an edit to any launcher's learning
    rate or warm-up is one line naming the file and key, exit 2 (one generate per backend, each edit undone)."""
    _, out = _generate(tmp_path, backend, lr_scaling="linear", lr_reference_batch=8)
    capsys.readouterr()
    assert main(["validate", str(out)]) == 0, capsys.readouterr().err
    for name, edit, says in EDITS[backend]:
        original = (out / name).read_text()
        edit(out / name)
        capsys.readouterr()
        assert main(["validate", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "regenerate" in lines[0], lines
        (out / name).write_text(original)
    assert main(["validate", str(out / "plan.json")]) == 0
