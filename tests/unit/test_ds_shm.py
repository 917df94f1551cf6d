"""DeepSpeed's CPU all-reduce segments in /dev/shm: a sweep removes the ones nobody maps and keeps a live launch's,
whichever test session started it."""

import mmap
import os

import pytest

from helpers import remove_segments_since
from toolkit.runtime.ds_shm import PREFIX, SHM_DIR, mapped

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")


def test_a_mapped_segment_survives_the_sweep_and_an_unmapped_one_goes(tmp_path):
    live = SHM_DIR / f"{PREFIX}_{os.getuid()}_127.0.0.1_1_0"
    left = SHM_DIR / f"{PREFIX}_{os.getuid()}_127.0.0.1_1_1"
    for path in (live, left):
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    try:
        with open(live, "r+b") as handle, mmap.mmap(handle.fileno(), mmap.PAGESIZE) as view:
            assert live in mapped() and left not in mapped()
            remove_segments_since(0)
            assert live.exists() and not left.exists()  # a peer that has yet to open it would hang without it
        remove_segments_since(0)
        assert not live.exists()  # unmapped: removed like any segment a launch left behind
    finally:
        for path in (live, left):
            path.unlink(missing_ok=True)
