"""Profiled steps without a launch: the recipe key and --profile-steps, the breakdown torch.profiler's own events give
(an accounting identity: the terms partition the step), the straggler and gap sentences, the report's refusal of a
run without profiled steps, and the incident's line where torch's flight recorder did not run."""

import base64
import json
import re
import warnings
from pathlib import Path

import pytest
import yaml

from helpers import tiny_prediction, write_run
from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.report.breakdown import (
    ESTIMATOR_LABELS,
    estimator_terms,
    largest_gap,
    ratio_words,
    read_breakdown,
    stragglers,
)
from toolkit.report.plot import predicted_by
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


def _train(profiler: StepProfiler, steps: int) -> None:
    """`steps` real training steps of a small MLP (AdamW) under the profiler, as a training loop calls it."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(1, steps + 1):
        profiler.begin_step(step)
        with profiler.span(DATA):
            batch = torch.randn(16, 64)
        model(batch).pow(2).mean().backward()
        profiler.enter(OPTIMIZER)
        optimizer.step()
        optimizer.zero_grad()
        profiler.leave(OPTIMIZER)
    profiler.close()


def test_a_profiled_window_writes_a_trace_and_terms_that_partition_each_step(tmp_path):
    profiler = StepProfiler(tmp_path, rank=0, first=2, last=3)
    _train(profiler, steps=5)
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


def test_memory_on_writes_the_timeline_with_allocations_in_each_profiled_step(tmp_path):
    """The recipe's `memory: true` on a CPU rank: torch's memory timeline as a plot and as raw events, which read back
    with the allocations of both recorded steps, placed in time by the trace's own step ranges; torch 2.13's
    deprecation warning of the export is handled at the seam (toolkit/compat/torch_seams.py), not passed on."""
    from torch.profiler._memory_profiler import Action  # torch's codes of the events' actions

    recipe = load_recipe(_recipe(tmp_path, profile={"start_step": 2, "steps": 2, "memory": True}))
    profiler = StepProfiler.from_recipe(recipe, tmp_path / "run", rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(profiler, steps=4)
    assert not [w for w in caught if "export_memory_timeline" in str(w.message)], [str(w.message) for w in caught]
    directory = tmp_path / "run" / "profile"
    assert sorted(str(p.relative_to(directory)) for p in profiler.written) == \
        ["breakdown/rank0.json", "memory/rank0.json", "rank0.2.pt.trace.json", "rank0.memory.html"]
    plot = re.search(r"base64,([A-Za-z0-9+/=]+)", (directory / "rank0.memory.html").read_text())
    assert plot and base64.b64decode(plot.group(1))[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((directory / "rank0.2.pt.trace.json").read_text())
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                   if e.get("name", "").startswith("ProfilerStep#"))
    assert len(steps) == 2
    events = json.loads((directory / "memory" / "rank0.json").read_text())  # [time ns, action, bytes, category]
    batch_bytes = 16 * 64 * 4  # each step's input, created in it
    for start, end in steps:  # the trace's times: microseconds after its baseTimeNanoseconds
        created = [size for time_ns, action, size, _ in events if action == Action.CREATE.value
                   and start <= (time_ns - trace["baseTimeNanoseconds"]) / 1e3 <= end]
        assert created and min(created) > 0 and sum(created) >= batch_bytes, (start, end, created)


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


def _prediction(**terms) -> dict:
    """A prediction's terms (StepTime's): zero but for `terms`."""
    return {**dict.fromkeys(ESTIMATOR_LABELS, 0.0), **terms}


def test_the_gap_is_named_by_the_estimators_own_term_where_one_stands_behind_it():
    measured = _terms(compute_s=0.2, communication_exposed_s=0.42, optimizer_s=0.05)
    prediction = _prediction(compute_s=0.2, dp_comm_s=0.2, optimizer_s=0.05)
    predicted = {"compute_s": 0.2, "communication_exposed_s": 0.2, "optimizer_s": 0.05, "data_wait_s": None,
                 "checkpoint_s": None, "idle_s": 0.0}
    terms = estimator_terms(prediction)
    assert terms["dp_comm_s"] == {"label": "exposed data-parallel communication", "predicted_s": 0.2,
                                  "measured_as": "communication_exposed_s"}
    assert set(terms) == set(ESTIMATOR_LABELS)
    assert largest_gap(measured, predicted, terms) == ("largest gap: exposed data-parallel communication 2.1x "
                                                       "predicted (0.42 s measured, 0.2 s predicted)")
    # several predicted communication terms: the measured one is their sum, the largest named as the likely one
    terms = estimator_terms(_prediction(compute_s=0.2, tp_comm_s=0.05, dp_comm_s=0.15, optimizer_s=0.05))
    sentence = largest_gap(measured, predicted, terms)
    assert sentence.startswith("largest gap: exposed communication 2.1x predicted (0.42 s measured, 0.2 s predicted)")
    assert "largest of which is exposed data-parallel communication (0.15 s of the 0.2 s predicted)" in sentence


def test_a_measured_term_below_the_prediction_is_worded_as_a_fraction_never_0x():
    assert ratio_words(0.0786, 6.53) == "83x below predicted (at 1.2% of it)"
    assert ratio_words(0.8, 1.0) == "1.2x below predicted (at 80% of it)"
    assert ratio_words(0.001, 10.0) == "10000x below predicted (at 0.01% of it)"
    assert ratio_words(0.42, 0.2) == "2.1x predicted" and ratio_words(25.0, 1.0) == "25x predicted"
    measured = _terms(compute_s=0.0786)
    predicted = {"compute_s": 6.53, "communication_exposed_s": 0.0, "optimizer_s": 0.0, "data_wait_s": None,
                 "checkpoint_s": None, "idle_s": 0.0}
    sentence = largest_gap(measured, predicted, estimator_terms(_prediction(compute_s=6.53)))
    assert sentence == ("largest gap: compute 83x below predicted (at 1.2% of it) (0.0786 s measured, "
                        "6.53 s predicted)")
    assert "0.0x" not in sentence


def _profiled_run(tmp_path, step_time_breakdown_s: dict) -> Path:
    """A run directory with run_plan.json (the tiny recipe's prediction with these terms) and two ranks' profiled
    steps as train.py writes them, rank 1 slower by compute."""
    prediction = tiny_prediction()
    prediction["step_time_breakdown_s"] = {**prediction["step_time_breakdown_s"], **step_time_breakdown_s}
    run = write_run(tmp_path / "run", prediction)
    (run / "profile" / "breakdown").mkdir(parents=True)
    for rank, (step_s, compute, communication) in enumerate(((0.8, 0.2, 0.5), (0.85, 0.5, 0.25))):
        steps = [{"step": step, **_terms(step_s=step_s, compute_s=compute, communication_exposed_s=communication,
                                         optimizer_s=0.05, idle_s=0.05)} for step in (2, 3)]
        (run / "profile" / "breakdown" / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": steps}))
    return run


def test_report_breakdown_shows_the_estimators_terms_and_the_per_rank_spread(tmp_path, capsys):
    run = _profiled_run(tmp_path, _prediction(compute_s=0.3, dp_comm_s=0.1, optimizer_s=0.05))
    assert main(["report", str(run), "--breakdown", "--json"]) == 0
    breakdown = json.loads(capsys.readouterr().out)["runs"][0]["breakdown"]
    assert breakdown["predicted"]["communication_exposed_s"] == pytest.approx(0.1)  # the merged terms stay
    assert breakdown["predicted_terms"]["dp_comm_s"]["predicted_s"] == pytest.approx(0.1)
    assert breakdown["predicted_terms"]["bubble_s"]["measured_as"] == "idle_s"
    assert breakdown["gap"].startswith("largest gap: exposed data-parallel communication 3.8x predicted"), breakdown
    assert breakdown["stragglers"]["spread_s"]["compute_s"] == pytest.approx(0.3)
    assert main(["report", str(run), "--breakdown"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "│ exposed data-parallel communication │ 0.1 │ exposed communication │ 0.375 │" in text, text
    assert "pipeline bubble" not in text  # predicted 0: in the JSON, not the table
    assert "per-rank spread" in text and "step 0.05 s, most in compute (0.3 s)" in text, text
    assert "slowest rank: 1, by compute" in text
    plot = tmp_path / "breakdown.png"
    assert main(["report", str(run), "--plot", str(plot)]) == 0  # --plot alone: a profiled run gets its bars
    png = plot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and "where the time went" not in capsys.readouterr().out
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1430, 1320), (width, height)  # 13 x 12 in at 110 dpi: a third row, the bars
    assert predicted_by(breakdown, "communication_exposed_s") == "exposed data-parallel communication 0.1"
    assert predicted_by(breakdown, "data_wait_s") == ""


def _kineto_trace(directory: Path, rank: int) -> None:
    """A Kineto GPU trace as torch.profiler writes it, built to known figures: two profiled steps of 1000 us, in each
    a GEMM at 0-400 us, an NCCL all-reduce on its own stream at 300-600 us (100 us under the GEMM) and a memory copy
    at 600-650 us, then nothing: per step the GPU computes 450 us (GEMM and copy), communicates 300 us (100
    overlapped, 200 exposed) and idles 350 us."""
    kernels = (("ampere_sgemm_128x64_nn", "kernel", 7, 0, 400),
               ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 20, 300, 300),
               ("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 7, 600, 50))
    events = []
    for index, start in enumerate((1000, 2000)):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{index + 2}", "pid": 1, "tid": 1,
                       "ts": start, "dur": 1000, "args": {}})
        for number, (name, category, stream, offset, duration) in enumerate(kernels):
            correlation = 100 * index + number + 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": start + 1 + number, "dur": 1, "args": {"correlation": correlation}})
            events.append({"ph": "X", "cat": category, "name": name, "pid": 0, "tid": stream, "ts": start + offset,
                           "dur": duration, "args": {"stream": stream, "correlation": correlation, "device": 0}})
    body = {"distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": events}
    (directory / f"rank{rank}.2.pt.trace.json").write_text(json.dumps(body))


def test_gpu_traces_are_split_by_holistic_trace_analysis_as_constructed(tmp_path):
    breakdown_dir = tmp_path / "profile" / "breakdown"
    breakdown_dir.mkdir(parents=True)
    for rank, data_wait in ((0, 0.0), (1, 1e-4)):  # rank 1's host waits 100 us for data, the GPU idle meanwhile
        _kineto_trace(tmp_path / "profile", rank)
        steps = [{"step": step, **_terms(step_s=1e-3, compute_s=1e-3, data_wait_s=data_wait)} for step in (2, 3)]
        (breakdown_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "device": "cuda", "steps": steps}))
    breakdown = read_breakdown(tmp_path, None)
    assert breakdown["source"].startswith("Holistic Trace Analysis")
    rows = {(row["step"], row["rank"]): row for row in breakdown["steps"]}
    assert sorted(rows) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    close = {"rel": 1e-3}  # HTA rounds its overlap to 0.01%
    for row in rows.values():
        assert row["communication_exposed_s"] == pytest.approx(200e-6, **close)  # the copy is not communication
        assert row["communication_overlapped_s"] == pytest.approx(100e-6, **close)
        assert row["compute_s"] == pytest.approx(450e-6, **close)  # the GEMM's 400 us and the copy's 50 us
        assert row["idle_s"] == pytest.approx(350e-6 - row["data_wait_s"])  # HTA's idle, less the host's wait
        assert sum(row[t] for t in TERMS) == pytest.approx(row["step_s"])


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


def test_an_earlier_jobs_flight_recorder_dump_is_never_unpickled(tmp_path, monkeypatch):
    """A reused output directory keeps an earlier job's attempt folders: a dump older than this process is counted,
    not handed to torch's analyser (which unpickles it), so a crafted one runs nothing."""
    import os
    import pickle

    from toolkit.runtime.incident import FR_DUMP_PREFIX, last_words_dir

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    directory = last_words_dir(tmp_path)
    directory.mkdir(parents=True)
    stale = directory / f"{FR_DUMP_PREFIX}0"
    stale.write_bytes(pickle.dumps(Payload()))
    os.utime(stale, (1_000_000_000, 1_000_000_000))  # 2001: before this process started
    event = analyse_collectives(tmp_path, world=1, wait_s=0)
    assert event["dumps"] == [] and event["stale_dumps"] == 1 and event["analysis"] == []
    assert event["recorder"] == "on, but no rank's dump arrived" and not marker.exists()


def test_a_damaged_breakdown_file_is_one_line_naming_it(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "profile" / "breakdown").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (run / "profile" / "breakdown" / "rank0.json").write_text(json.dumps({"rank": 0, "steps": [{"step": 1}]}))
    assert main(["report", str(run), "--breakdown"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank0.json: not a profile breakdown" in err[0], err
