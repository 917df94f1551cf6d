"""A rank's dense peak FLOP/s, the figure every step time and MFU is a share of: the catalogue's datasheet value, or
for its `cpu` entry, which has no datasheet, the rate this host reaches on square matmuls, measured the first time a
prediction needs it, with the matmul benchmark `dmt health` runs on every rank (one matmul measurement in the
toolkit).

The catalogue (toolkit/spec/cluster.py) only declares the entries; the measurement sits here, in the lowest layer
that predicts with it.
"""

from __future__ import annotations

import logging
import os
import time
from functools import lru_cache

from toolkit.errors import UserInputError
from toolkit.spec.cluster import GPU, peak_key

log = logging.getLogger(__name__)

HOST_MATMUL_SIZE = 512  # as dmt health on CPU ranks: large enough to keep the vector units busy, quick to run
HOST_MATMUL_SECONDS = 0.3
# the best of several short windows: a peak is what the host reaches when nothing else runs, and a window that
# another process shared (a launcher, a sibling rank starting up) shows as a slower one
HOST_MATMUL_WINDOWS = 6
# the peak key of a precision (spec.cluster.peak_key) -> the dtype its matmuls run in on a host CPU
HOST_DTYPES = {"bf16": "bfloat16", "tf32": "float32", "fp8": "bfloat16"}


def matmul_benchmark(device, seconds: float, size: int | None = None, dtype=None) -> dict:
    """Square matmuls for a fixed wall-clock window, so that an outside slowdown (throttling, contention) shows.

    bf16 on GPUs, fp32 on CPUs unless `dtype` says otherwise. Returns {matmul_ms: mean time of one matmul,
    matmul_gflops, matmul_size, matmul_dtype}.
    """
    import torch

    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    size = size or (8192 if cuda else HOST_MATMUL_SIZE)  # 8192^2 bf16 reaches a GPU's tensor-core peak
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # first call pays for kernel selection and page faults
    if cuda:
        torch.cuda.synchronize(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
        if cuda and count % 8 == 0:
            torch.cuda.synchronize(device)  # keep the queue short so the window means GPU time
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return {"matmul_ms": elapsed / count * 1e3, "matmul_gflops": 2 * size**3 * count / elapsed / 1e9,
            "matmul_size": size, "matmul_dtype": str(dtype).removeprefix("torch.")}


def host_cores() -> int:
    """The cores this process may run on (its affinity mask, as a launcher or Slurm set it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@lru_cache(maxsize=None)
def host_matmul_tflops(key: str, threads: int | None = None) -> float:
    """TFLOP/s of this host on HOST_MATMUL_SIZE^2 matmuls in the dtype of a peak key (bf16, tf32 = fp32 here), with
    `threads` threads (default: every core this process may use), the best of HOST_MATMUL_WINDOWS windows; once per
    process, key and thread count, so every prediction of a process sees one figure. `dmt calibrate` measures at the
    thread count the runs' ranks computed with together (their ranks per node x threads per rank)."""
    import torch

    dtype = getattr(torch, HOST_DTYPES.get(key, "bfloat16"))
    previous = torch.get_num_threads()
    threads = threads or host_cores()
    torch.set_num_threads(threads)  # a launched rank may have been given one thread; the host has them all
    try:
        windows = [matmul_benchmark(torch.device("cpu"), HOST_MATMUL_SECONDS / HOST_MATMUL_WINDOWS, HOST_MATMUL_SIZE,
                                    dtype) for _ in range(HOST_MATMUL_WINDOWS)]
    finally:
        torch.set_num_threads(previous)
    result = max(windows, key=lambda window: window["matmul_gflops"])
    log.info("host peak (%s): %.1f GFLOP/s with %d threads on %d cores, %dx%d matmuls", key, result["matmul_gflops"],
             threads, host_cores(), HOST_MATMUL_SIZE, HOST_MATMUL_SIZE)
    return result["matmul_gflops"] / 1e3


def peak_flops(gpu: GPU, precision: str, ranks_per_node: int = 1, key: str | None = None) -> float:
    """Dense peak FLOP/s of one rank at a training precision (`key`: a peak_tflops key of its own, as a low-precision
    recipe's GEMMs run at). The host entry's peak is the host's matmul rate (from a calibration file, else measured
    now by host_matmul_tflops), split evenly between the ranks it runs."""
    key = key or peak_key(precision)
    if gpu.host:
        tflops = gpu.peak_tflops.get(key) or host_matmul_tflops(key)
        return tflops * 1e12 / max(1, ranks_per_node)
    if key not in gpu.peak_tflops:  # never another precision's rate in its place
        raise UserInputError("--precision", f"{gpu.name}'s catalogue entry has no dense {key} peak for {precision} "
                                            f"(toolkit/presets/gpus.yaml peak_tflops)")
    return gpu.peak_tflops[key] * 1e12
