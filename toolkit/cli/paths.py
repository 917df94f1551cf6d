"""The argparse type of every path flag: an empty value is a mistake, not the current directory (Path("") is ".")."""

from __future__ import annotations

import argparse
from pathlib import Path


def path_arg(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a path")
    return Path(text)
