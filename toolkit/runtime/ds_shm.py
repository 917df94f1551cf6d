"""DeepSpeed's CPU all-reduce segments: created per rank, never removed by DeepSpeed.

On CPU ranks DeepSpeed 0.19 builds its shared-memory all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp), which creates
/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (66 MiB a rank) and never unlinks it.
/dev/shm is RAM: every CPU launch would leave 66 MiB per rank behind until the machine reboots (18 GiB after a day of
test runs on the 24 GiB development VM, when a DeepSpeed save was killed for memory).
"""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"


def segments(port: str | int | None = None, rank: int | None = None) -> list[Path]:
    """This user's segments, of one master port (and one rank) when given."""
    pattern = f"{PREFIX}_{os.getuid()}_*"
    if port is not None:
        pattern += f"_{port}_{rank if rank is not None else '*'}"
    return sorted(SHM_DIR.glob(pattern)) if SHM_DIR.is_dir() else []


def in_use() -> set[Path]:
    """This user's segments some live process holds open or maps (a launch running now, maybe another test
    session's): only the others may be removed by a sweep that did not start the launch. The open descriptor counts
    too: DeepSpeed's shared_create opens the segment, writes its 66 MiB (a while on a loaded machine) and only then
    maps it, and a segment removed in between leaves its peers waiting for it for ever."""
    found = set()
    for process in Path("/proc").glob("[0-9]*"):
        try:
            text = (process / "maps").read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        found.update(Path(line.split(maxsplit=5)[5]) for line in text.splitlines()
                     if PREFIX in line and len(line.split(maxsplit=5)) == 6 and not line.endswith(" (deleted)"))
        try:
            descriptors = list((process / "fd").iterdir())
        except OSError:
            continue
        for descriptor in descriptors:
            try:
                target = os.readlink(descriptor)
            except OSError:
                continue
            if PREFIX in target and not target.endswith(" (deleted)"):
                found.add(Path(target))
    return found


def release(port: str | int | None, rank: int | None = None) -> int:
    """Unlink the segments of a finished (or killed) launch; ranks still running keep their mappings. Returns count."""
    removed = 0
    for path in segments(port, rank):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def release_at_exit() -> None:
    """Called by a CPU rank once DeepSpeed's process group exists: its own segment goes when the process ends (every
    peer has opened it by then: DeepSpeed maps all segments during init_distributed)."""
    import atexit

    port, rank = os.environ.get("MASTER_PORT"), os.environ.get("RANK")
    if port is not None and rank is not None:
        atexit.register(release, port, int(rank))

