"""Fixtures of the checkpoint tests: private copies of the real ZeRO checkpoints that a test may damage, and the
checks every refusal must pass (exit 2, one line naming the flag or file, nothing changed or left behind)."""

import hashlib
import shutil
from pathlib import Path

import pytest

from toolkit.cli.main import main


@pytest.fixture
def zero_copy(zero_checkpoints, tmp_path):
    """zero_copy("zero1-tied" | "zero2" | "zero3") -> a copy the test may damage."""

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(zero_checkpoints[name], target)
        return target

    return copy


@pytest.fixture
def zero3_copy(zero_copy) -> Path:
    return zero_copy("zero3")


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under `root` (hidden ones included), files with their sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def refused(capsys, tmp_path):
    """refused(argv, *says) runs `dmt argv` in this process and asserts a refusal: exit code 2, one line on stderr
    that names each of `says`, no traceback, and nothing under the test's tmp_path changed, added or left behind.
    Returns the line."""

    def run(argv: list[str], *says: str) -> str:
        capsys.readouterr()
        before = tree(tmp_path)
        code = main([str(a) for a in argv])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, err
        assert "Traceback" not in err and all(s in lines[0] for s in says), (lines, says)
        assert tree(tmp_path) == before
        return lines[0]

    return run
