"""Tests only: put on PYTHONPATH of a launched run with DMT_GUARD_PROBE=FILE, every process of it appends one line to
FILE per look the guard takes at the gradients (toolkit.runtime.guard.read_grad_norm: rank, type and size of what it
read) and per torch.isfinite called from the toolkit's own code (a finite check of gradient tensors coming back)."""

import os

PROBE = os.environ.get("DMT_GUARD_PROBE")


def _record(line: str) -> None:
    with open(PROBE, "a") as handle:
        handle.write(f"{line} rank={os.environ.get('RANK', '0')}\n")


if PROBE:
    import sys

    import torch

    from toolkit.runtime import guard

    read_grad_norm, isfinite = guard.read_grad_norm, torch.isfinite
    TOOLKIT = os.sep + "toolkit" + os.sep

    def counted_read(norm):
        _record(f"read_grad_norm {type(norm).__name__} numel={norm.numel() if hasattr(norm, 'numel') else 1}")
        return read_grad_norm(norm)

    def watched_isfinite(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if TOOLKIT in caller:
            _record(f"isfinite {caller}")
        return isfinite(*args, **kwargs)

    guard.read_grad_norm, torch.isfinite = counted_read, watched_isfinite
