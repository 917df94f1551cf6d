"""Paths, sizes and launches shared by the FSDP2 tests and their fixtures."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, TRAIN  # noqa: F401  (the FSDP tests import it from here)

BIN = Path(sys.executable).parent
TINY_FSDP = ROOT / "recipes" / "tiny-llama-fsdp-cpu.yaml"
PROBE = Path(__file__).resolve().parent / "fsdp_fallback_probe.py"
STEPS = 12  # the tiny corpus's loss falls by more than 1 in 12 steps; a checkpoint every 6
MOE_FAMILY = "mixtral"  # what conftest.moe_reshard trains (helpers.TINY_MOE: transformers' fused 3-D expert tensors)
MOE_STEPS, MOE_SAVE_AT = 8, 4  # its loss falls by more than 1 in 8 steps


def environment() -> dict:
    return dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def restore_test(workdir: Path, *flags: str) -> dict:
    """`dmt restore-test ... --json` as a user runs it: reference run, SIGKILL after a save, resume, comparison."""
    cmd = [str(BIN / "dmt"), "restore-test", "--workdir", str(workdir), "--json", *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, env=environment(), timeout=900)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    return json.loads(result.stdout)
