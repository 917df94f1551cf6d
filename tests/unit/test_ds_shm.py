"""DeepSpeed's CPU all-reduce segments in /dev/shm: a sweep removes the ones nobody holds and keeps a live launch's,
whichever test session started it."""

import mmap
import os
import time

import pytest

from helpers import SEGMENT_SETTLE_S, remove_segments_since
from toolkit.runtime.ds_shm import PREFIX, SHM_DIR, in_use

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")


def test_a_held_segment_survives_the_sweep_and_a_released_one_goes():
    """Mapped (a running rank's), or only open (DeepSpeed's shared_create writes 66 MiB through the descriptor before
    it maps it): kept; once let go, removed like any segment a launch left behind."""
    mapped, written, left = (SHM_DIR / f"{PREFIX}_{os.getuid()}_127.0.0.1_1_{rank}" for rank in range(3))
    for path in (mapped, written, left):
        path.write_bytes(b"\0" * mmap.PAGESIZE)
        _age(path)
    try:
        with open(mapped, "r+b") as handle, mmap.mmap(handle.fileno(), mmap.PAGESIZE):
            handle.close()  # the mapping alone holds it
            descriptor = os.open(written, os.O_RDWR)
            try:
                assert {mapped, written} <= in_use() and left not in in_use()
                remove_segments_since(0)
                assert mapped.exists() and written.exists() and not left.exists()
            finally:
                os.close(descriptor)
        for path in (mapped, written):
            _age(path)
        remove_segments_since(0)
        assert not mapped.exists() and not written.exists()
    finally:
        for path in (mapped, written, left):
            path.unlink(missing_ok=True)


def test_a_segment_created_while_a_sweep_reads_proc_is_left_to_a_later_sweep():
    """Nobody holds it yet, but it is newer than the sweep: a rank may be creating it (the process was read before it
    opened the file), as a sibling pytest-xdist worker's or another session's launch does."""
    fresh = SHM_DIR / f"{PREFIX}_{os.getuid()}_127.0.0.1_2_0"
    fresh.write_bytes(b"\0" * mmap.PAGESIZE)
    try:
        assert fresh not in in_use()
        remove_segments_since(0)
        assert fresh.exists()
        _age(fresh)
        remove_segments_since(0)
        assert not fresh.exists()
    finally:
        fresh.unlink(missing_ok=True)


def _age(path) -> None:
    """As a segment a launch wrote a while ago (older than the settling time a sweep leaves new ones)."""
    past = time.time() - 10 * SEGMENT_SETTLE_S
    os.utime(path, (past, past))
