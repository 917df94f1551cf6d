"""What a checkpoint cost, as metrics.jsonl records it (toolkit.backends.loop.write_checkpoint_record) and `dmt report`
sums it up: count, median pause, median time to complete, and the share of the run spent paused; where
training.async_save lands in the generated files."""

import json

import pytest
import yaml

from helpers import ROOT, tiny_prediction
from helpers import RUN_STEPS as STEPS
from helpers import write_run as _write_run
from toolkit.backends.loop import write_checkpoint_record
from toolkit.cli.main import main
from toolkit.runtime.metrics import METRICS_FILE, MetricsWriter, keep_until, read_checkpoint_records, read_metrics

# (step, paused s, complete after s): a synchronous save at step 4, background writes at 8 and at the last step
SAVES = [(4, 0.5, 0.5), (8, 0.1, 2.0), (STEPS, 0.3, 1.0)]


@pytest.fixture(scope="module")
def prediction():
    return tiny_prediction()


def _with_checkpoints(run, saves=SAVES):
    """Each save's record appended after its step's record, as the training loops write them."""
    lines = (run / METRICS_FILE).read_text().splitlines()
    metrics, out = MetricsWriter(run, 1), []
    (run / METRICS_FILE).write_text("")
    for line in lines:
        (run / METRICS_FILE).open("a").write(line + "\n")
        step = json.loads(line)["step"]
        for at, paused, complete in saves:
            if at == step:
                manifest = {"step": at, "files": {"common.pt": {"bytes": 1000, "sha256": "0"},
                                                  "__0_0.distcp": {"bytes": 24, "sha256": "1"}}}
                out.append(write_checkpoint_record(metrics, manifest, run / f"checkpoint-{at}", paused, complete,
                                                   asynchronous=paused < complete))
    return out


def _report(capsys, run) -> dict:
    assert main(["report", str(run), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["runs"][0]


def test_each_checkpoint_has_a_record_beside_the_step_records(tmp_path, prediction):
    run = _write_run(tmp_path / "run", prediction)
    written = _with_checkpoints(run)
    assert [r["step"] for r in read_metrics(run)] == list(range(1, STEPS + 1))  # step records as before
    records = read_checkpoint_records(run)
    assert records == written and [r["checkpoint"] for r in records] == ["checkpoint-4", "checkpoint-8",
                                                                          f"checkpoint-{STEPS}"]
    assert [(r["async"], r["bytes"]) for r in records] == [(False, 1024), (True, 1024), (True, 1024)]


def test_report_sums_up_what_the_checkpoints_cost(tmp_path, prediction, capsys):
    run = _write_run(tmp_path / "run", prediction)
    _with_checkpoints(run)
    entry = _report(capsys, run)
    step_time = prediction["step_time_s"] * 1.2  # write_run's steps
    # the pauses of the saves at steps 4 and 8 lie inside step records; the last one's after them
    elapsed = STEPS * step_time + 0.3
    assert entry["checkpoints"] == {"count": 3, "blocking_s": pytest.approx(0.3), "persist_s": pytest.approx(1.0),
                                    "stall_fraction": pytest.approx(0.9 / elapsed)}
    assert main(["report", str(run)]) == 0
    assert f"3 x 0.3 / 1 ({0.9 / elapsed:.1%})" in capsys.readouterr().out


def test_a_run_without_checkpoint_records_has_none_to_sum(tmp_path, prediction, capsys):
    entry = _report(capsys, _write_run(tmp_path / "run", prediction))
    assert entry["checkpoints"] == {"count": 0, "blocking_s": None, "persist_s": None, "stall_fraction": None}


@pytest.mark.parametrize("change, names", [
    ({"blocking_s": -0.1}, "blocking_s"),
    ({"bytes": 1.5}, "bytes"),
    ({"step": 2}, "the checkpoint of step 2 after the checkpoint of step 4"),
])
def test_a_damaged_checkpoint_record_damages_the_run(tmp_path, prediction, capsys, change, names):
    run = _write_run(tmp_path / "run", prediction)
    _with_checkpoints(run)
    lines = (run / METRICS_FILE).read_text().splitlines()
    number = max(i for i, line in enumerate(lines) if '"kind": "checkpoint"' in line and '"step": 8' in line)
    lines[number] = json.dumps({**json.loads(lines[number]), **change})
    (run / METRICS_FILE).write_text("\n".join(lines) + "\n")
    entry = _report(capsys, run)
    assert entry["status"] == "damaged" and f"metrics.jsonl line {number + 1}" in entry["reason"], entry["reason"]
    assert names in entry["reason"] and entry["checkpoints"]["count"] is None


def test_a_resume_moves_the_later_checkpoint_records_aside_with_the_steps(tmp_path, prediction):
    run = _write_run(tmp_path / "run", prediction)
    _with_checkpoints(run)
    keep_until(run, 4)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert [r["step"] for r in read_checkpoint_records(run)] == [4]


@pytest.mark.parametrize("accelerator, async_save, expected", [
    ("gpu", None, True), ("cpu", None, False), ("cpu", True, True), ("gpu", False, False), ("cpu", False, False)])
def test_async_save_reaches_megatron_yaml_and_megatron_lm_flags(tmp_path, capsys, accelerator, async_save, expected):
    """Unset, on where Megatron-Core saves asynchronously as the library ships it (GPUs); on CPU ranks when asked."""
    recipe = yaml.safe_load((ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml").read_text())
    recipe["data"]["train_files"] = [str(ROOT / "recipes" / f) for f in recipe["data"]["train_files"]]
    recipe["cluster"]["accelerator"] = accelerator
    if async_save is not None:
        recipe["training"]["async_save"] = async_save
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["generate", str(path), "--out", str(tmp_path / "gen")]) == 0, capsys.readouterr().err
    assert yaml.safe_load((tmp_path / "gen" / "megatron.yaml").read_text())["schedule"]["async_save"] is expected
    flags = (tmp_path / "gen" / "megatron_args.txt").read_text().split()
    assert ("--async-save" in flags and "--use-persistent-ckpt-worker" in flags) is expected


def test_async_save_is_a_yes_or_no(tmp_path, capsys):
    recipe = yaml.safe_load((ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml").read_text())
    recipe["training"]["async_save"] = "sometimes"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["generate", str(path), "--out", str(tmp_path / "gen")]) == 2
    err = capsys.readouterr().err
    assert "training.async_save" in err and "true or false" in err and len(err.strip().splitlines()) == 1
