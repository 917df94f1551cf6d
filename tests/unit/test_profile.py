"""Profiled steps without a launch: the recipe key and --profile-steps, the breakdown torch.profiler's own events give
(an accounting identity: the terms partition the step), the straggler and gap sentences, the report's refusal of a
run without profiled steps, and the incident's line where torch's flight recorder did not run."""

import json
from pathlib import Path

import pytest
import yaml

from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.report.breakdown import largest_gap, stragglers
from toolkit.runtime.incident import analyse_collectives
from toolkit.runtime.profile import DATA, OPTIMIZER, TERMS, StepProfiler, parse_step_range
from toolkit.spec.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-llama-cpu.yaml"


def _recipe(tmp_path, **training) -> Path:
    recipe = yaml.safe_load(TINY.read_text())
    recipe["data"]["train_files"] = [str(TINY.parent / f) for f in recipe["data"]["train_files"]]
    recipe["training"].update(training)
    path = tmp_path / "profiled.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.mark.parametrize("text, expected", [("3-4", (3, 4)), ("5", (5, 5)), (" 2 - 6 ", (2, 6))])
def test_profile_steps_read_as_a_range(text, expected):
    assert parse_step_range(text) == expected


@pytest.mark.parametrize("text", ["4-3", "0-2", "a-b", "3-", ""])
def test_a_bad_profile_range_names_what_is_valid(text):
    with pytest.raises(ValueError, match="valid: A-B"):
        parse_step_range(text)


def test_the_recipe_key_is_off_by_default_and_read_when_set(tmp_path):
    assert load_recipe(TINY).training.profile is None
    profile = load_recipe(_recipe(tmp_path, profile={"start_step": 3, "ranks": [1], "memory": True})).training.profile
    assert (profile.start_step, profile.steps, profile.last_step, profile.ranks, profile.memory) == (3, 2, 4, [1], True)
    with pytest.raises(UserInputError, match="training.profile.steps"):
        load_recipe(_recipe(tmp_path, profile={"start_step": 3, "steps": 0}))


def test_train_py_refuses_a_window_past_the_run_or_a_rank_outside_it(tmp_path):
    from toolkit.train import _profiled

    recipe = load_recipe(TINY)
    profiled = _profiled(recipe, "2-3", world=2)
    assert (profiled.training.profile.start_step, profiled.training.profile.steps) == (2, 2)
    with pytest.raises(UserInputError, match="--profile-steps"):
        _profiled(recipe, f"2-{recipe.training.max_steps + 1}", world=2)
    ranked = load_recipe(_recipe(tmp_path, profile={"start_step": 2, "ranks": [0, 2]}))
    with pytest.raises(UserInputError, match="training.profile.ranks: rank 2 is not in this launch of 2"):
        _profiled(ranked, None, world=2)
    assert _profiled(recipe, None, world=2) is recipe  # off: nothing changes


def test_the_profile_key_travels_in_plan_json(tmp_path, capsys):
    recipe = _recipe(tmp_path, profile={"start_step": 2, "steps": 1})
    assert main(["generate", str(recipe), "--out", str(tmp_path / "gen")]) == 0
    capsys.readouterr()
    settings = json.loads((tmp_path / "gen" / "plan.json").read_text())["recipe_settings"]
    assert settings["training"]["profile"]["start_step"] == 2  # train.py --plan reads the recipe it names


def test_a_profiled_window_writes_a_trace_and_terms_that_partition_each_step(tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    profiler = StepProfiler(tmp_path, rank=0, first=2, last=3)
    for step in range(1, 6):
        profiler.begin_step(step)
        with profiler.span(DATA):
            batch = torch.randn(16, 64)
        model(batch).pow(2).mean().backward()
        profiler.enter(OPTIMIZER)
        optimizer.step()
        optimizer.zero_grad()
        profiler.leave(OPTIMIZER)
    profiler.close()
    assert sorted(str(p.relative_to(tmp_path / "profile")) for p in (tmp_path / "profile").rglob("*.json")) == \
        ["breakdown/rank0.json", "rank0.2.pt.trace.json"]
    trace = json.loads((tmp_path / "profile" / "rank0.2.pt.trace.json").read_text())
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= {e.get("name") for e in trace["traceEvents"]}  # steps 2 and 3
    steps = json.loads((tmp_path / "profile" / "breakdown" / "rank0.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [2, 3]
    for step in steps:
        assert sum(step[t] for t in TERMS) == pytest.approx(step["step_s"], rel=1e-9)
        assert step["compute_s"] > 0 and step["optimizer_s"] > 0 and step["data_wait_s"] > 0
        assert step["communication_exposed_s"] == 0 == step["communication_overlapped_s"]  # no process group


def test_off_nothing_is_built(tmp_path):
    profiler = StepProfiler.from_recipe(load_recipe(TINY), tmp_path, rank=0)
    for step in (1, 2):
        profiler.begin_step(step)
        with profiler.span(DATA):
            pass
    profiler.close()
    assert profiler._profiler is None and not (tmp_path / "profile").exists()


def test_a_rank_not_chosen_records_nothing(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, profile={"start_step": 1, "ranks": [1]}))
    assert StepProfiler.from_recipe(recipe, tmp_path, rank=0).active is False
    assert StepProfiler.from_recipe(recipe, tmp_path, rank=1).active is True


def _terms(**values) -> dict:
    return {"step_s": 1.0, **dict.fromkeys(TERMS, 0.0), "communication_overlapped_s": 0.0, **values}


def test_the_straggler_is_the_rank_the_others_wait_for_named_with_its_term():
    per_rank = {0: _terms(compute_s=0.3, communication_exposed_s=0.6, idle_s=0.1),
                1: _terms(compute_s=0.85, communication_exposed_s=0.05, idle_s=0.1)}
    result = stragglers(per_rank)
    assert (result["rank"], result["term"]) == (1, "compute_s")
    assert result["spread_s"]["compute_s"] == pytest.approx(0.55)
    assert result["sentence"].startswith("slowest rank: 1, by compute")
    assert stragglers({0: per_rank[0]})["rank"] is None  # one rank: no straggler


def test_the_largest_gap_is_one_sentence():
    measured = _terms(compute_s=0.2, communication_exposed_s=0.42, optimizer_s=0.05)
    predicted = {"compute_s": 0.2, "communication_exposed_s": 0.2, "optimizer_s": 0.05, "data_wait_s": None,
                 "checkpoint_s": None, "idle_s": 0.0}
    assert largest_gap(measured, predicted).startswith("largest gap: exposed communication 2.1x predicted")
    assert "does not model" in largest_gap(_terms(data_wait_s=0.9), {**predicted, "communication_exposed_s": 0.0,
                                                                      "compute_s": 0.0, "optimizer_s": 0.0})
    assert largest_gap(measured, None) is None


def test_report_breakdown_of_a_run_without_profiled_steps_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert main(["report", str(run), "--breakdown", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["breakdown"] is None
    assert main(["report", str(run), "--breakdown"]) == 0
    assert "no profiled steps" in capsys.readouterr().out


def test_the_incident_says_when_the_flight_recorder_did_not_run(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    event = analyse_collectives(tmp_path, world=2, wait_s=0)
    assert event["event"] == "collectives" and event["collective"] is None
    assert event["recorder"].startswith("torch's flight recorder was off")


def test_a_damaged_breakdown_file_is_one_line_naming_it(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "profile" / "breakdown").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (run / "profile" / "breakdown" / "rank0.json").write_text(json.dumps({"rank": 0, "steps": [{"step": 1}]}))
    assert main(["report", str(run), "--breakdown"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank0.json: not a profile breakdown" in err[0], err
