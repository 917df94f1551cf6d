"""Fixtures of the checkpoint tests: a private copy of a real ZeRO-3 checkpoint that a test may damage."""

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def zero3_copy(zero_checkpoints, tmp_path) -> Path:
    copy = tmp_path / "zero3"
    shutil.copytree(zero_checkpoints["zero3"], copy)
    return copy
