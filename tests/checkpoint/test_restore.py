"""`dmt restore-test` on the tiny recipe with ZeRO 3, and at another world size with ZeRO 2, and a save killed midway
never becoming `latest`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, TINY, TRAIN, free_port
from toolkit.checkpoint.manifest import MANIFEST, resolve_latest
from toolkit.checkpoint.verify import verify
from toolkit.cli.main import main
from toolkit.runtime.metrics import read_metrics

pytestmark = pytest.mark.launch


def test_restore_is_identical_to_the_bit(tmp_path, capsys):
    """ZeRO-3 (the recipe's ZeRO-2 resumes bitwise after a SIGKILL in tests/training/test_faults.py's automatic
    restart, and through this command at another world size below, which is why it has no restore-test of its own
    here: three DeepSpeed launches, ~70 s of the launch lane, for what those two already show)."""
    code = main(["restore-test", "--recipe", str(TINY), "--steps", "10", "--save-at", "5", "--zero", "3",
                 "--workdir", str(tmp_path), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["passed"] and result["identical"], result["mismatches"]
    assert result["max_abs_diff"] == 0.0 and len(result["reference_losses"]) == 5
    assert result["reference_losses"] == result["resumed_losses"]
    assert result["killed_at_step"] is not None and result["killed_at_step"] < 10  # it really died before the end
    reference = read_metrics(tmp_path / "reference")
    assert reference[-1]["loss"] < reference[0]["loss"] - 1.0
    assert verify(Path(result["checkpoint"])).ok


def test_restore_at_another_world_size_goes_through_a_universal_checkpoint(tmp_path, capsys):
    """ZeRO-2 saved by 2 ranks, resumed by 1: DeepSpeed's ds_to_universal converts a hard-linked copy, the engine
    loads it universally; the same global batches per step, the loss within the stated tolerance, the user's
    checkpoint untouched."""
    code = main(["restore-test", "--recipe", str(TINY), "--steps", "6", "--save-at", "3", "--resume-world-size", "1",
                 "--workdir", str(tmp_path), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["passed"], result["mismatches"]
    assert result["tolerance"] == 1e-3 and 0 < result["max_abs_diff"] <= 1e-3  # resharded: not bitwise, but close
    assert (tmp_path / "interrupted" / "universal" / "checkpoint-3" / "latest_universal").is_file()
    assert verify(Path(result["checkpoint"])).ok  # the original still matches its manifest


def test_a_save_killed_midway_leaves_the_previous_checkpoint_latest(tmp_path):
    out = tmp_path / "run"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           *TRAIN, "--recipe", str(TINY), "--max-steps", "30", "--save-steps", "2",
           "--output-dir", str(out)]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    caught = None
    # Polls every 5 ms for a checkpoint directory without its manifest (a save of the tiny model is in progress for
    # tens of ms, 14 times in the run) and kills the launch there. The wait ends at the first save caught, so its
    # bound only has to cover DeepSpeed's start (~50 s under load ~10 on 2 cores, minutes under heavier load) and a
    # few steps: 1200 s (the former 300 s left ~5x at load ~10).
    deadline = time.monotonic() + 1200
    try:
        while time.monotonic() < deadline and process.poll() is None and caught is None:
            latest = resolve_latest(out)
            for ckpt in out.glob("checkpoint-*") if out.exists() else []:
                # a checkpoint directory without its manifest is a save in progress: kill it right there
                if latest is not None and ckpt != latest and not (ckpt / MANIFEST).exists():
                    os.killpg(process.pid, signal.SIGKILL)
                    caught = ckpt
                    break
            time.sleep(0.005)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert caught is not None, "never caught a save in progress"
    latest = resolve_latest(out)
    assert latest != caught and (latest / MANIFEST).is_file()
    assert verify(latest).ok
    assert int(latest.name.split("-")[1]) < int(caught.name.split("-")[1])


def test_a_worker_error_is_the_commands_one_line_through_a_pipe(tmp_path):
    """A recipe value only training finds wrong (the tokenizer holds more tokens than the model's vocabulary): the
    reference run's workers refuse it, and `dmt restore-test`, read through a pipe, ends with their line (exit 2).
    Without --workdir the runs went to a temp dir of the command's own: a failed test keeps it, and the line names
    the log in it."""
    import re

    import yaml

    megatron = ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml"
    data = yaml.safe_load(megatron.read_text())
    data["data"]["train_files"] = [str(megatron.parent / f) for f in data["data"]["train_files"]]
    data["model"]["config"]["vocab_size"] = 300
    recipe = tmp_path / "small-vocab.yaml"
    recipe.write_text(yaml.safe_dump(data))
    result = subprocess.run([sys.executable, "-m", "toolkit", "restore-test", "--recipe", str(recipe), "--steps", "4"],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ, TMPDIR=str(tmp_path),
                            PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert re.match(r"dmt restore-test: error: model.config.vocab_size: \d+ < tokenizer size \d+ ", lines[0]), lines
    (workdir,) = tmp_path.glob("dmt-restore-*")
    assert f"(the reference run; log: {workdir / 'reference.log'})" in lines[0]
    assert "vocab_size" in (workdir / "reference.log").read_text()
