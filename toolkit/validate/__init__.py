"""Validators: the libraries' own config classes plus the rules they only check at launch; `Problem` is one finding."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: the dotted key at fault, and a message with the conflicting values and the fix."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"
