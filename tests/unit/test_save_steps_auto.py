"""`training.save_steps: auto` (issue 25): `dmt generate` writes Daly's optimum interval for the planned step time
into the generated files, plan.json says why, and a launch saves at that number."""

import json

import pytest
import yaml

from helpers import ROOT
from toolkit.cli.main import main
from toolkit.planner.save_interval import run_save_steps
from toolkit.spec.recipe import load_recipe, recipe_model
from toolkit.validate.generated import read_generated


def _recipe(tmp_path, backend: str, **training) -> object:
    recipe = yaml.safe_load((ROOT / "recipes" / "llama-3.1-70b-64xh100.yaml").read_text())
    recipe["training"].update({"save_steps": "auto", "max_steps": 200_000, **training})
    recipe["plan"]["backend"] = backend
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
def test_generate_writes_dalys_interval_and_plan_json_says_why(tmp_path, capsys, backend):
    recipe = _recipe(tmp_path, backend)
    out = tmp_path / "out"
    assert main(["generate", str(recipe), "--out", str(out)]) == 0
    record = json.loads((out / "plan.json").read_text())
    why = record["save_interval"]
    steps = why["save_steps"]
    assert 1 < steps < 200_000 and why["step_time_s"] == record["step_time_s"]
    assert why["interval_s"] == pytest.approx(steps * record["step_time_s"])
    assert why["mtbf_h"] == pytest.approx(1 / (why["failure_rate_per_gpu_hour"] * 64))
    assert "Daly" in why["rule"] and why["checkpoint_bytes"] > 0
    assert record["recipe_settings"]["training"]["save_steps"] == "auto"  # the recipe as written
    if backend == "megatron":
        assert yaml.safe_load((out / "megatron.yaml").read_text())["schedule"]["save_interval"] == steps
        assert f"--save-interval {steps}" in (out / "megatron_args.txt").read_text().splitlines()
    else:
        assert json.loads((out / "trainer_args.json").read_text())["save_steps"] == steps
    # training reads the same directory back without calling the recipe changed, and saves at that number
    run = read_generated(out / "plan.json")
    assert run_save_steps(run.recipe, run.model, run.plan, run.prediction) == steps
    # launched from the recipe alone (no plan.json), the same resolution is made
    loaded = load_recipe(recipe)
    assert run_save_steps(loaded, recipe_model(loaded), run.plan, None) == steps


def test_a_number_stays_a_number_and_a_bad_value_names_the_key(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["generate", str(_recipe(tmp_path, "deepspeed", save_steps=300)), "--out", str(out)]) == 0
    assert "save_interval" not in json.loads((out / "plan.json").read_text())
    assert json.loads((out / "trainer_args.json").read_text())["save_steps"] == 300
    assert main(["generate", str(_recipe(tmp_path, "deepspeed", save_steps="often")), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "training.save_steps" in err and "Traceback" not in err
