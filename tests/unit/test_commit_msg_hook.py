"""The commit-msg hook (.githooks/commit-msg) holds CONTRIBUTING.md's commit shape: a subject of at most 72
characters, then a blank line."""

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[2] / ".githooks" / "commit-msg"


def run_hook(tmp_path: Path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run(["sh", str(HOOK), str(path)], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("message", ["x" * 72 + "\n", "Subject\n\nBody line\n", "é" * 72 + "\n",
                                     "# a comment git strips\nSubject\n\nBody\n"])
def test_a_subject_of_at_most_72_characters_and_a_blank_line_pass(tmp_path, message):
    assert run_hook(tmp_path, message).returncode == 0


@pytest.mark.parametrize(("message", "said"), [("x" * 73 + "\n", "73 characters"),
                                               ("Subject\nbody at once\n", "second line"),
                                               ("\n\nBody\n", "empty")])
def test_other_shapes_are_refused_with_one_line(tmp_path, message, said):
    result = run_hook(tmp_path, message)
    assert result.returncode == 1
    assert said in result.stderr and len(result.stderr.strip().splitlines()) == 1
