"""Constants shared by the Megatron-Core tests and their fixtures."""

import sys
from pathlib import Path

from helpers import ROOT, TINY_MOE, TRAIN  # noqa: F401  (the Megatron tests import them from here)

BIN = Path(sys.executable).parent
TINY_MEGATRON = ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml"
STEPS, SAVE_AT = 8, 4  # enough for the tiny corpus's loss to fall clearly; the resume tests restart at SAVE_AT
RESAVE_AT = SAVE_AT + 2  # the dp2 run resumed from its background save saves synchronously here (conftest.dp2_resumed)

MOE_STEPS = 6
