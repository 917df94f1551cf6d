"""Run directories that come from elsewhere: `dmt report` and `dmt calibrate` on records that are damaged (NaN, zero,
negative or infinite figures, repeated or decreasing steps, lines that are not records, a run_plan.json that is not
one), on a run without run_plan.json, and on runs whose plan names other hardware than they trained on.

Each run directory is written as toolkit/train.py writes it (start_run_record and end_run_record with the tiny
recipe's real prediction, MetricsWriter's records), then damaged the way a copy, an edit or a second launch would.
A damaged run is reported with its status and the file, line and key at fault, and no figure; calibrate refuses it
in one line and writes nothing."""

import json
import math

import pytest
import yaml
from test_fuzz_verbs import _assert_refused, _run

from helpers import H100_RANKS as H100
from helpers import RUN_STEPS as STEPS
from helpers import tiny_prediction
from helpers import write_run as _write_run
from toolkit.cli.main import main
from toolkit.runtime.metrics import METRICS_FILE, RUN_FILE

CPU_RANKS = {"accelerator": "cpu", "device": "cpu", "device_gpu": "cpu"}


@pytest.fixture(scope="module")
def prediction():
    """The tiny recipe's prediction, as train.py records it in run_plan.json; computed once for the module."""
    return tiny_prediction()


def _edit_line(number: int, text: str | None = None, **changes):
    """Damage metrics.jsonl line `number`: replaced by `text`, or its keys changed (json.dumps writes NaN and
    Infinity literals, as Python's json does by default)."""
    def edit(run):
        lines = (run / METRICS_FILE).read_text().splitlines()
        lines[number - 1] = text if text is not None else json.dumps({**json.loads(lines[number - 1]), **changes})
        (run / METRICS_FILE).write_text("\n".join(lines) + "\n")
    return edit


def _edit_record(text_edit=None, **changes):
    """Damage run_plan.json: its keys changed, or its text edited."""
    def edit(run):
        path = run / RUN_FILE
        if text_edit is not None:
            path.write_text(text_edit(path.read_text()))
        else:
            path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))
    return edit


def _relaunched(run):
    """A second launch into the same directory from step 1 (no resume): every step appears twice."""
    lines = (run / METRICS_FILE).read_text()
    (run / METRICS_FILE).write_text(lines + lines)


# damage -> what the report's reason must name (file, line, key)
DAMAGE = {
    "NaN step time": (_edit_line(5, step_time_s=math.nan), "metrics.jsonl line 5 holds nan at step_time_s"),
    "zero step time": (_edit_line(6, step_time_s=0), "metrics.jsonl line 6: step_time_s"),
    "negative step time": (_edit_line(7, step_time_s=-0.25), "metrics.jsonl line 7: step_time_s"),
    "infinite step time": (_edit_line(5, step_time_s=math.inf), "metrics.jsonl line 5 holds inf at step_time_s"),
    "step time past the float range": (_edit_line(5, '{"step": 5, "step_time_s": 1e999}'),
                                       "metrics.jsonl line 5 holds inf at step_time_s"),
    "step time as text": (_edit_line(5, step_time_s="0.5"), "metrics.jsonl line 5: step_time_s"),
    "NaN MFU": (_edit_line(8, mfu=math.nan), "metrics.jsonl line 8 holds nan at mfu"),
    "negative data wait": (_edit_line(8, data_wait_s=-1.0), "metrics.jsonl line 8: data_wait_s"),
    # finite and of the right sign, but no run shows them: implausible, never a completed run's figures
    "MFU of 500%": (_edit_line(8, mfu=5.0), "metrics.jsonl line 8: mfu: implausible"),
    "step time of 1e308 s": (_edit_line(5, step_time_s=1e308), "metrics.jsonl line 5: step_time_s: implausible"),
    "data wait of 1e300 s": (_edit_line(8, data_wait_s=1e300), "metrics.jsonl line 8: data_wait_s: implausible"),
    "predicted MFU of 500%": (_edit_record(mfu=5.0), "run_plan.json: mfu: implausible"),
    "predicted step time of 1e308 s": (_edit_record(step_time_s=1e308), "run_plan.json: step_time_s: implausible"),
    "negative per-rank bytes": (_edit_line(8, gpu_max_allocated_bytes_per_rank=[2**30, -5]),
                                "metrics.jsonl line 8: gpu_max_allocated_bytes_per_rank.1"),
    "repeated step": (_edit_line(6, step=5), "metrics.jsonl line 6: step 5 after step 5"),
    "decreasing step": (_edit_line(6, step=2), "metrics.jsonl line 6: step 2 after step 5"),
    "step as a float": (_edit_line(6, step=6.0), "metrics.jsonl line 6: step"),
    "no step": (_edit_line(6, '{"loss": 1.0, "step_time_s": 0.5}'), "metrics.jsonl line 6: step: missing"),
    "a line that is a list": (_edit_line(4, "[1, 2, 3]"), "metrics.jsonl line 4 holds a list"),
    "a line that is a number": (_edit_line(4, "42"), "metrics.jsonl line 4 holds a int"),
    "a line that is not JSON": (_edit_line(4, '{"step": 4, "loss":'), "metrics.jsonl line 4 is not valid JSON"),
    "relaunched into the same directory": (_relaunched, f"metrics.jsonl line {STEPS + 1}: step 1 after step {STEPS}"),
    "infinite predicted MFU": (_edit_record(lambda t: t.replace('"mfu": ', '"mfu": Infinity, "was": ', 1)),
                               "run_plan.json holds inf at mfu"),
    "NaN predicted step time": (_edit_record(step_time_s=math.nan), "run_plan.json holds nan at step_time_s"),
    "zero predicted step time": (_edit_record(step_time_s=0.0), "run_plan.json: step_time_s"),
    "predicted memory as text": (_edit_record(memory_bytes={"total": "1 GiB"}), "run_plan.json: memory_bytes.total"),
    "an unknown status": (_edit_record(status="done"), "run_plan.json: status"),
    "a plan the model cannot take": (_edit_record(plan=None), None),  # replaced below: tp 3 of 4 heads
    "an unknown GPU": (_edit_record(gpu="h100-81gb"), "run_plan.json: gpu: unknown GPU 'h100-81gb'"),
    "a calibration scale as text": (_edit_record(calibration={"file": "c.yaml", "hardware": "h100-80gb",
                                                              "compute_scale": {"hf": "fast"}}),
                                    "run_plan.json: calibration.compute_scale.hf"),
    "run_plan.json a list": (_edit_record(lambda t: "[1, 2]"), "run_plan.json holds a list"),
    "run_plan.json not JSON": (_edit_record(lambda t: t[: len(t) // 2]), "run_plan.json is not valid JSON"),
}


def _tp3(run):
    record = json.loads((run / RUN_FILE).read_text())
    record["plan"] = {**record["plan"], "tp": 3}
    (run / RUN_FILE).write_text(json.dumps(record))


DAMAGE["a plan the model cannot take"] = (_tp3, "run_plan.json: plan.tp")


def _strict_json(text: str):
    """The output as JSON that has no NaN or Infinity in it (json.loads would take them silently)."""
    def refuse(name):
        raise AssertionError(f"{name} in the output")
    return json.loads(text, parse_constant=refuse)


def _report(capsys, *argv) -> dict:
    """`dmt report ... --json`: exit 0, and its output JSON without NaN or Infinity."""
    code = main(["report", *map(str, argv), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return _strict_json(captured.out)


def _table(capsys, run, reason: str) -> str:
    """`dmt report RUN` as a table: exit 0, the run's status and reason in it, and no NaN or infinity printed as a
    figure (the reason may name one: it is what is wrong)."""
    code = main(["report", str(run)])
    table = capsys.readouterr().out
    assert code == 0 and reason in table, table
    figures = table.replace(reason, "").lower().replace("/", " ").split()
    assert not {"nan", "inf", "infinity", "-inf"} & set(figures), table
    return table


def _figures_are_sound(entry: dict) -> None:
    """Every figure of a report entry finite, and every step time (measured or predicted) above 0."""
    for group in ("measured", "predicted", "error"):
        for key, value in entry[group].items():
            if value is not None:
                assert math.isfinite(value), (group, key, value)
                assert group == "error" or "step_time" not in key or value > 0, (group, key, value)


def test_a_sound_run_is_reported_with_its_figures_and_calibrates_for_its_gpu(tmp_path, capsys, prediction):
    """The control every damaged case below differs from by its damage alone."""
    run = _write_run(tmp_path / "run", prediction)
    entry = _report(capsys, run)["runs"][0]
    assert entry["status"] == "completed" and entry["steps"] == STEPS
    assert entry["measured"]["step_time_s"] == pytest.approx(prediction["step_time_s"] * 1.2)
    assert entry["error"]["step_time"] == pytest.approx(1 / 1.2 - 1)
    _figures_are_sound(entry)
    out = tmp_path / "calibration.yaml"
    assert main(["calibrate", str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert yaml.safe_load(out.read_text())["hardware"] == "h100-80gb"


def test_an_mfu_above_one_is_implausible_only_against_a_datasheet_peak(tmp_path, capsys, prediction):
    """On the host entry (CPU ranks) the peak is a matmul probe measured at launch, which a run's own GEMMs can beat
    (the calibration benchmark's Megatron-Core run at micro-batch 8 logged 1.0009): its run is reported, not damaged.
    The same MFU on a catalogue GPU is damage (the DAMAGE table's 500%)."""
    for gpu, status in (("cpu", "completed"), ("h100-80gb", "damaged")):
        run = _write_run(tmp_path / gpu, {**prediction, "gpu": gpu}, device=CPU_RANKS if gpu == "cpu" else H100)
        for line in range(1, STEPS + 1):  # every record, so the median the table shows is above 1 too
            _edit_line(line, mfu=1.0009)(run)
        entry = _report(capsys, run)["runs"][0]
        assert entry["status"] == status, entry["reason"]
        if gpu == "cpu":  # the table says why, in one line (the demo's first report read MFU 253.9%)
            table = _table(capsys, run, "completed")
            assert "MFU above 100%: the uncalibrated `cpu` peak is this host's 512x512 matmul rate" in table, table


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_run_is_reported_as_damaged_without_figures_and_calibrate_refuses_it(tmp_path, capsys, prediction,
                                                                                       damage):
    damage_it, names = DAMAGE[damage]
    run = _write_run(tmp_path / "run", prediction)
    damage_it(run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    entry = _report(capsys, run)["runs"][0]
    assert entry["status"] == "damaged" and names in entry["reason"], entry["reason"]
    assert set(entry["measured"].values()) == {None} and entry["error"] == {"step_time": None, "memory": None}
    assert entry["steps"] <= STEPS  # a repeated step is never counted
    _figures_are_sound(entry)
    assert f"damaged: {entry['reason']}" in _table(capsys, run, entry["reason"])
    out = tmp_path / "calibration.yaml"
    code, err = _run(capsys, ["calibrate", str(run), "--out", str(out)])
    _assert_refused(code, err, "RUN_DIR", str(run), "is damaged", names)
    assert not out.exists()
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # reading a run changes nothing in it


def test_a_run_without_run_plan_json_is_not_called_completed_and_does_not_calibrate(tmp_path, capsys, prediction):
    """Only metrics.jsonl (run_plan.json lost in a copy): whether the run finished, and what it was predicted to do,
    are not known; its step times are not vouched for as a finished run's."""
    run = _write_run(tmp_path / "run", prediction)
    (run / RUN_FILE).unlink()
    entry = _report(capsys, run)["runs"][0]
    assert entry["status"] == "no-record" and "no run_plan.json" in entry["reason"]
    assert entry["steps"] == STEPS and set(entry["measured"].values()) == {None}
    assert f"no-record: {entry['reason']}" in _table(capsys, run, entry["reason"])
    out = tmp_path / "calibration.yaml"
    code, err = _run(capsys, ["calibrate", str(run), "--out", str(out)])
    _assert_refused(code, err, "RUN_DIR", str(run), "is no-record", "no run_plan.json")
    assert not out.exists()


# where a run trained (run_plan.json `launch`), its plan's GPU -> what calibrate's one line says (None: calibrates)
HARDWARE = {
    "CPU ranks, an h100 plan": (CPU_RANKS, "h100-80gb", "trained on CPU ranks but its plan is for h100-80gb"),
    "CPU ranks by the recipe alone (no device recorded), an h100 plan": (
        {"accelerator": "cpu"}, "h100-80gb", "trained on CPU ranks but its plan is for h100-80gb"),
    "a GPU recipe where CUDA was missing, an h100 plan": (
        {"accelerator": "gpu", "device": "cpu", "device_gpu": "cpu"}, "h100-80gb",
        "trained on CPU ranks but its plan is for h100-80gb"),
    "an H100, a plan for the host's CPU ranks": (H100, "cpu", "trained on NVIDIA H100 80GB HBM3 but its plan is for "
                                                              "the host's CPU ranks (cpu)"),
    "an A100, an h100 plan": ({"accelerator": "gpu", "device": "NVIDIA A100-SXM4-80GB", "device_gpu": "a100-80gb"},
                              "h100-80gb", "trained on NVIDIA A100-SXM4-80GB (a100-80gb) but its plan is for h100-80gb"),
    "nowhere recorded": ({}, "h100-80gb", "does not say where the run trained"),
    "a GPU the catalogue does not know, an h100 plan": (
        {"accelerator": "gpu", "device": "NVIDIA Unknown Accelerator", "device_gpu": None}, "h100-80gb", None),
    "an H100, an h100 plan": (H100, "h100-80gb", None),
}


@pytest.mark.parametrize("case", sorted(HARDWARE))
def test_a_calibration_is_for_the_hardware_the_runs_used(tmp_path, capsys, prediction, case):
    """dmt calibrate on runs of a recipe naming one GPU that trained elsewhere (the tiny recipe names h100-80gb and
    trains on 2 CPU ranks) refuses in one line and writes nothing: a compute scale fitted to CPU step times, filed
    under h100-80gb, would predict an 8B model on 8 H100s at an hour a step."""
    device, gpu, says = HARDWARE[case]
    run = _write_run(tmp_path / "run", {**prediction, "gpu": gpu}, device=device)
    out = tmp_path / "calibration.yaml"
    if says is None:
        assert main(["calibrate", str(run), "--out", str(out)]) == 0, capsys.readouterr().err
        assert yaml.safe_load(out.read_text())["hardware"] == gpu
        return
    code, err = _run(capsys, ["calibrate", str(run), "--out", str(out)])
    _assert_refused(code, err, "RUN_DIR", str(run), says, "a calibration is for the hardware the runs used")
    assert not out.exists()
    assert _report(capsys, run)["runs"][0]["status"] == "completed"  # the report still compares it: it is sound


def test_one_cpu_trained_run_among_gpu_runs_stops_the_calibration(tmp_path, capsys, prediction):
    sound = _write_run(tmp_path / "h100", prediction)
    cpu = _write_run(tmp_path / "cpu", prediction, device=CPU_RANKS)
    out = tmp_path / "calibration.yaml"
    code, err = _run(capsys, ["calibrate", str(sound), str(cpu), "--out", str(out)])
    _assert_refused(code, err, str(cpu), "trained on CPU ranks but its plan is for h100-80gb")
    assert not out.exists()


def test_a_damaged_run_beside_a_sound_one_keeps_its_status_under_a_calibration(tmp_path, capsys, prediction):
    """dmt report of two runs, one with a line that is no record, re-predicted with a calibration fitted on the
    other: the sound run is compared, the damaged one keeps its status and no figure."""
    sound = _write_run(tmp_path / "sound", prediction)
    damaged = _write_run(tmp_path / "damaged", prediction)
    _edit_line(6, '["not", "a", "record"]')(damaged)
    calibration = tmp_path / "calibration.yaml"
    assert main(["calibrate", str(sound), "--out", str(calibration)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    report = _report(capsys, sound, damaged, "--calibration", calibration)
    first, second = report["runs"]
    assert first["status"] == "completed" and first["calibration"]["file"] == str(calibration)
    assert first["measured"]["step_time_s"] > 0 and first["error"]["step_time"] is not None
    assert second["status"] == "damaged" and second["steps"] == 5 and set(second["measured"].values()) == {None}


def test_a_damaged_run_is_plotted_beside_a_sound_one_not_a_traceback(tmp_path, capsys, prediction):
    sound = _write_run(tmp_path / "sound", prediction)
    damaged = _write_run(tmp_path / "damaged", prediction)
    _edit_line(6, '["not", "a", "record"]')(damaged)
    plot = tmp_path / "report.png"
    assert main(["report", str(sound), str(damaged), "--plot", str(plot)]) == 0, capsys.readouterr().err
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_launch_on_cpu_ranks_records_that_it_trained_there():
    """What train.py writes into run_plan.json's `launch` for the check above (on a GPU: torch's device name and
    the catalogue entry it is)."""
    from toolkit.train import _device

    assert _device("cpu") == {"device": "cpu", "device_gpu": "cpu"}
