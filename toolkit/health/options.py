"""What one health run is asked to do (HealthOptions); where a rank stands (RankEnv) is toolkit.runtime.job's."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserInputError
from toolkit.runtime.job import HOSTNAME_ENV, STORE_HOSTED_ENV, RankEnv, rank_env  # noqa: F401 (re-exported)

# Small on CPU so `--nproc 2` takes seconds; on GPUs up to 1 GiB, where NCCL reaches its link speed.
CPU_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 24)
GPU_SIZES = (1 << 10, 1 << 20, 1 << 24, 1 << 28, 1 << 30)


@dataclass(frozen=True)
class HealthOptions:
    """Every knob of one run; the CLI builds it, spawned ranks receive it as JSON."""

    sizes: tuple[int, ...] | None = None
    """Message sizes in bytes (nccl-tests' S of each op); None: CPU_SIZES or GPU_SIZES."""
    iters: int | None = None
    """Timed iterations per op and size (nccl-tests -n); None: 5 on CPU, 20 on GPUs."""
    deadline_s: float = 60.0
    """A rank whose heartbeat or step stops moving this long is unresponsive."""
    straggler_factor: float = 2.0
    """A rank whose matmul takes this many times the other ranks' median time is a straggler; links likewise."""
    min_busbw_gbps: float | None = None
    """Intra-node all_reduce busbw floor; None: half the catalogue link speed on GPUs, none on CPU."""
    min_inter_busbw_gbps: float | None = None
    """Inter-node all_reduce busbw floor; None: half the catalogue network speed on GPUs, none on CPU."""
    min_matmul_fraction: float = 0.25
    """On GPUs, the share of the catalogue's dense bf16 peak the matmul benchmark must reach."""
    matmul_seconds: float = 1.0
    """Wall-clock length of the per-rank matmul benchmark."""
    mem_fraction: float = 0.5
    """Share of free GPU memory each rank must be able to allocate."""
    expected_devices: int | None = None
    """GPUs every rank must see; None: the launcher's ranks per node (LOCAL_WORLD_SIZE) when it says."""
    gpu: str | None = None
    """Catalogue GPU for the default thresholds; None: recognised from the device name."""
    pid_dir: str | None = None
    """Each rank writes rank<N>.pid here once its heartbeat runs, and rank<N>.step naming each step as it enters it
    (operators attaching a debugger; tests stopping a rank at a known point)."""
    heartbeat_s: float = 0.25
    """Heartbeat period of every rank; the monitors read at the same rate."""

    def sizes_for(self, cuda: bool) -> tuple[int, ...]:
        return self.sizes or (GPU_SIZES if cuda else CPU_SIZES)

    def iters_for(self, cuda: bool) -> int:
        return self.iters or (20 if cuda else 5)


def validate(options: HealthOptions) -> None:
    """Single-field and cross-field rules, each naming the flag at fault."""
    positive = {"--deadline-s": options.deadline_s, "--matmul-seconds": options.matmul_seconds,
                "--straggler-factor": options.straggler_factor}
    for flag, value in positive.items():
        if not value > 0:
            raise UserInputError(flag, f"must be positive, got {value}")
    if options.straggler_factor <= 1:
        raise UserInputError("--straggler-factor", f"must be above 1 (1.5 = 50% slower), got {options.straggler_factor}")
    if options.matmul_seconds >= options.deadline_s:
        raise UserInputError("--matmul-seconds", f"must be shorter than --deadline-s ({options.deadline_s}), "
                                                 f"or a healthy rank would look hung; got {options.matmul_seconds}")
    if not 0 < options.mem_fraction <= 0.95:
        raise UserInputError("--mem-fraction", f"must be in (0, 0.95], got {options.mem_fraction}")
    if not 0 <= options.min_matmul_fraction <= 1:
        raise UserInputError("--min-matmul-fraction", f"must be in [0, 1], got {options.min_matmul_fraction}")
    if options.iters is not None and options.iters < 1:
        raise UserInputError("--iters", f"must be at least 1, got {options.iters}")
    if options.expected_devices is not None and options.expected_devices < 1:
        raise UserInputError("--expect-devices", f"must be at least 1, got {options.expected_devices}")
    for flag, value in (("--min-busbw-gbps", options.min_busbw_gbps), ("--min-inter-busbw-gbps", options.min_inter_busbw_gbps)):
        if value is not None and value < 0:
            raise UserInputError(flag, f"must not be negative, got {value}")
