"""Profiled steps against a straggler and a hang, one tiny launch (torchrun, FSDP2, 2 CPU ranks over gloo): rank 1 is
slowed on purpose by extra compute in steps 2 and 3 (DMT_FAULT busy, toolkit/runtime/faults.py), which are profiled;
then it stops in step 4 while rank 0 goes on into the step's collectives. `dmt report --breakdown` names rank 1 the
straggler by compute, rank 0 shows the wait as communication or idle, and the watchdog's incident carries torch's
flight recorder analysis of the ranks' dumps naming the collective rank 1 never joined."""

import json

import pytest

from helpers import BIN, TRAIN, free_port, run_logged
from toolkit.cli.main import main
from toolkit.runtime.incident import read_incidents

pytestmark = pytest.mark.launch
# 256x256 products rank 1 adds to each profiled step: several times the tiny step's own compute on any host
EXTRA_PRODUCTS = 300
FAULT = (f"busy={EXTRA_PRODUCTS}@rank=1,step=2,phase=train;busy={EXTRA_PRODUCTS}@rank=1,step=3,phase=train;"
         f"hang@rank=1,step=4,phase=train")


@pytest.fixture(scope="module")
def straggler(variant, tmp_path_factory):
    recipe = variant("tiny-straggler", training={"max_steps": 5, "save_steps": 0, "hang_timeout_s": 10.0,
                                                 "max_restarts": 0})
    out = tmp_path_factory.mktemp("straggler") / "run"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), *TRAIN,
           "--recipe", str(recipe), "--backend", "fsdp", "--output-dir", str(out), "--profile-steps", "2-3"]
    rc = run_logged(cmd, out.parent / "train.log", 1800, {"DMT_FAULT": FAULT, "OMP_NUM_THREADS": "1"})
    return rc, out, (out.parent / "train.log").read_text()


def _breakdown(out, capsys) -> dict:
    assert main(["report", str(out), "--breakdown", "--json"]) == 0
    [run] = json.loads(capsys.readouterr().out)["runs"]
    return run["breakdown"]


def test_the_slowed_rank_is_named_the_straggler_by_compute(straggler, capsys):
    rc, out, log = straggler
    breakdown = _breakdown(out, capsys)
    assert breakdown is not None, log[-3000:]
    rows = breakdown["steps"]
    assert sorted({(r["step"], r["rank"]) for r in rows}) == [(2, 0), (2, 1), (3, 0), (3, 1)], rows
    for row in rows:  # an accounting identity over the profiler's events: the terms partition the step
        terms = sum(row[t] for t in ("compute_s", "communication_exposed_s", "data_wait_s", "optimizer_s",
                                     "checkpoint_s", "idle_s"))
        assert abs(terms - row["step_s"]) <= 0.1 * row["step_s"], row
        assert row["compute_s"] > 0 and terms - row["idle_s"] <= row["step_s"] * (1 + 1e-9), row
    straggler_ = breakdown["stragglers"]
    assert (straggler_["rank"], straggler_["term"]) == (1, "compute_s"), straggler_
    assert "slowest rank: 1, by compute" in straggler_["sentence"]


def test_the_waiting_rank_shows_the_wait_as_communication_or_idle_not_compute(straggler, capsys):
    _, out, _ = straggler
    rows = _breakdown(out, capsys)["steps"]
    for step in (2, 3):
        fast, slow = (next(r for r in rows if (r["step"], r["rank"]) == (step, rank)) for rank in (0, 1))
        assert fast["compute_s"] < slow["compute_s"], (fast, slow)
        waited = fast["communication_exposed_s"] + fast["idle_s"]
        assert waited > slow["communication_exposed_s"] + slow["idle_s"], (fast, slow)


def test_the_traces_are_written_per_rank_and_holistic_trace_analysis_opens_them(straggler):
    from hta.trace_analysis import TraceAnalysis

    _, out, _ = straggler
    traces = sorted(p.name for p in (out / "profile").glob("*.pt.trace.json"))
    assert traces == ["rank0.2.pt.trace.json", "rank1.2.pt.trace.json"], traces
    analysis = TraceAnalysis(trace_dir=str(out / "profile"), include_last_profiler_step=True)
    assert sorted(analysis.t.get_ranks()) == [0, 1]
    symbols = analysis.t.symbol_table.sym_table
    for rank in (0, 1):
        names = {symbols[index] for index in analysis.t.get_trace(rank)["name"]}
        assert {"ProfilerStep#1", "ProfilerStep#2"} <= names  # the two profiled steps (2 and 3 of the run)
        assert any(name.startswith("gloo:") for name in names)  # the collectives are in the trace


def test_a_hang_in_one_ranks_collective_is_named_by_the_flight_recorder(straggler):
    rc, out, log = straggler
    assert rc != 0, log[-3000:]
    events = read_incidents(out)
    hang = next(e for e in events if e["event"] == "hang")
    assert [u["rank"] for u in hang["unresponsive"]] == [1] or 1 in [u["rank"] for u in hang["unresponsive"]], hang
    collectives = next(e for e in events if e["event"] == "collectives")
    assert collectives["recorder"] == "on" and collectives["dumps"] == [0, 1], collectives
    assert collectives["collective"] and collectives["collective"].startswith("gloo:"), collectives
    assert collectives["missing_ranks"] == [1], collectives
    assert any("Not all ranks joining collective" in line for line in collectives["analysis"]), collectives


def test_the_report_prints_the_breakdown_and_plots_its_bars(straggler, capsys, tmp_path):
    _, out, _ = straggler
    plot = tmp_path / "report.png"
    assert main(["report", str(out), "--breakdown", "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "where the time went" in printed and "slowest rank: 1, by compute" in printed, printed
    assert "largest gap: " in printed
    assert plot.stat().st_size > 0 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
