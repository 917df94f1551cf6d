"""The argparse types of path flags: what a command reads (registered as its inputs) and what it writes."""

from __future__ import annotations

import argparse
from pathlib import Path

from toolkit.outputs import note_input

# Every flag that names a path takes one of these types, and that is the whole of how a verb declares its inputs:
# toolkit.outputs refuses any output of the command that would replace one (the same file, any link followed, or a
# file inside an input directory), whichever flag names the output.


def _given(text: str) -> Path:
    if not text.strip():  # Path("") is ".", the current directory: an empty value is a mistake
        raise argparse.ArgumentTypeError("is empty; give a path")
    return Path(text)


def path_arg(text: str) -> Path:
    """A file or directory the command reads."""
    path = _given(text)
    note_input(path)
    return path


def output_arg(text: str) -> Path:
    """A file or directory the command writes (checked by toolkit.outputs against every input)."""
    return _given(text)


def source_arg(text: str) -> str:
    """A name that may be a local path or something else (a preset, a hub id): an input when it exists here."""
    try:
        if Path(text).expanduser().exists():
            note_input(Path(text))
    except (OSError, ValueError):  # a name too long, or with a NUL, is no file here
        pass
    return text


PATH_TYPES = (path_arg, output_arg, source_arg)  # the flags that name a path on this machine
