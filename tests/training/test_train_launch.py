"""toolkit/train.py under `deepspeed` and `accelerate launch` on 2 CPU ranks with the tiny recipe: the run trains."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, TINY, free_port, run_logged
from toolkit.backends.metrics import read_metrics
from toolkit.checkpoint.manifest import resolve_latest
from toolkit.checkpoint.verify import verify
from toolkit.cli.main import main

pytestmark = pytest.mark.distributed
BIN = Path(sys.executable).parent


def _assert_trained(out: Path, steps: int) -> list[dict]:
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for record in records:
        assert {"step", "loss", "grad_norm", "learning_rate", "tokens_per_s", "data_sha"} <= set(record)
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 1.0, (first, last)  # the tiny corpus is learnable: the loss clearly falls
    latest = resolve_latest(out)
    assert latest is not None and latest.name == f"checkpoint-{steps}"
    report = verify(latest)
    assert report.ok and report.manifest, report.problems
    return records


@pytest.fixture(scope="module")
def zero1_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero1") / "run"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(ROOT / "toolkit/train.py"),
           "--recipe", str(TINY), "--zero", "1", "--max-steps", "20", "--output-dir", str(out)]
    return out, run_logged(cmd, out.parent / "train.log")


def test_deepspeed_zero1_trains_and_checkpoints(zero1_run):
    out, rc = zero1_run
    _assert_trained(out, 20)
    assert rc == 0


@pytest.mark.parametrize("zero", [2, 3])
def test_accelerate_launch_with_generated_config(tmp_path, zero, capsys):
    gen, out = tmp_path / "gen", tmp_path / "run"
    assert main(["generate", str(TINY), "--out", str(gen), "--zero", str(zero)]) == 0
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(gen / "accelerate.yaml"), "--main_process_port",
           str(free_port()), str(ROOT / "toolkit/train.py"), "--recipe", str(TINY), "--zero", str(zero),
           "--deepspeed", str(gen / "deepspeed.json"), "--output-dir", str(out)]
    rc = run_logged(cmd, tmp_path / "train.log")
    _assert_trained(out, 30)
    assert json.loads((out / f"checkpoint-30/dmt_manifest.json").read_text())["layout"]["zero"] == zero
    assert rc == 0


def test_resume_of_a_different_run_is_refused(zero1_run, tmp_path):
    out, _ = zero1_run
    changed = tmp_path / "changed.yaml"
    changed.write_text(TINY.read_text().replace("global_batch: 16", "global_batch: 32"))
    (tmp_path / "data").symlink_to(ROOT / "recipes/data")
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(ROOT / "toolkit/train.py"),
           "--recipe", str(changed), "--zero", "1", "--max-steps", "25", "--output-dir", str(out), "--resume"]
    rc = run_logged(cmd, tmp_path / "resume.log")
    log = (tmp_path / "resume.log").read_text()
    assert rc != 0 and "belongs to a different run (global_batch: 16 -> 32)" in log


def test_bad_recipe_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("max_steps: 30", "max_steps: 30\n  max_stepz: 3"))
    result = subprocess.run([sys.executable, str(ROOT / "toolkit/train.py"), "--recipe", str(bad)],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, WORLD_SIZE="2"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("train.py: error: bad.yaml: training.max_stepz")


def test_torchrun_launch_trains(tmp_path):
    out = tmp_path / "run"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(ROOT / "toolkit/train.py"),
           "--recipe", str(TINY), "--max-steps", "8", "--output-dir", str(out)]
    rc = run_logged(cmd, tmp_path / "train.log")
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 9)) and records[-1]["loss"] < records[0]["loss"]
    assert verify(resolve_latest(out)).ok
    assert rc == 0
