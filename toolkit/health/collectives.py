"""Collective sweeps with nccl-tests' bandwidth definitions, correctness checks, matmul speed and link tests.

algbw = S / t, with S the per-rank buffer size nccl-tests reports for each op (the full, gathered size for
all_gather / reduce_scatter); busbw = algbw x the op's bus factor (toolkit/estimate/comm.py BUS_FACTOR, the same
numbers the planner's cost model uses), which is comparable to link speed (nccl-tests doc/PERFORMANCE.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from toolkit.estimate.comm import BUS_FACTOR

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def _run_op(op: str, size_bytes: int, world: int, rank: int, device, group=None) -> tuple[float, bool]:
    """One timed collective of `size_bytes` (full size); (seconds, result correct)."""
    import torch
    import torch.distributed as dist

    numel = max(world, size_bytes // 4 // world * world)
    chunk = numel // world
    if op == "all_reduce":
        tensor = torch.full((numel,), float(rank + 1), device=device)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        elapsed = time.perf_counter() - start
        return elapsed, bool(torch.all(tensor == world * (world + 1) / 2))
    if op == "all_gather":
        local = torch.full((chunk,), float(rank), device=device)
        out = torch.empty(numel, device=device)
        start = time.perf_counter()
        dist.all_gather_into_tensor(out, local, group=group)
        elapsed = time.perf_counter() - start
        expected = torch.arange(world, device=device, dtype=out.dtype).repeat_interleave(chunk)
        return elapsed, bool(torch.equal(out, expected))
    if op == "reduce_scatter":
        full = torch.arange(numel, device=device, dtype=torch.float32)
        out = torch.empty(chunk, device=device)
        start = time.perf_counter()
        dist.reduce_scatter_tensor(out, full, group=group)
        elapsed = time.perf_counter() - start
        expected = torch.arange(rank * chunk, (rank + 1) * chunk, device=device, dtype=torch.float32) * world
        return elapsed, bool(torch.equal(out, expected))
    if op == "broadcast":
        tensor = torch.full((numel,), 7.0 if rank == 0 else 0.0, device=device)
        start = time.perf_counter()
        dist.broadcast(tensor, src=0, group=group)
        elapsed = time.perf_counter() - start
        return elapsed, bool(torch.all(tensor == 7.0))
    raise ValueError(op)


def bandwidths(op: str, size_bytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s as nccl-tests defines them."""
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else float("inf")
    return algbw, algbw * BUS_FACTOR[op](world)


def sweep(sizes: list[int], world: int, rank: int, device, progress: Callable[[str], None], iters: int = 3) -> dict:
    """Every op at every size: the best of `iters` timings (after one warm-up), busbw, and correctness on all ranks."""
    import torch
    import torch.distributed as dist

    results: dict = {}
    for op in OPS:
        for size in sizes:
            progress(f"{op}:{size}")
            _run_op(op, size, world, rank, device)
            timings, correct = [], True
            for _ in range(iters):
                seconds, ok = _run_op(op, size, world, rank, device)
                timings.append(seconds)
                correct &= ok
            flag = torch.tensor([1.0 if correct else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # correct only if correct everywhere
            best = min(timings)
            algbw, busbw = bandwidths(op, size, best, world)
            results.setdefault(op, {})[str(size)] = {"time_s": best, "algbw_gbps": algbw, "busbw_gbps": busbw,
                                                     "correct": bool(flag.item() == 1.0)}
    return results


def ring_links(world: int, rank: int, device, size_bytes: int, progress: Callable[[str], None]) -> list[dict]:
    """Point-to-point bandwidth of every ring link rank -> rank+1; each rank measures the link it sends on."""
    import torch
    import torch.distributed as dist

    numel = max(1, size_bytes // 4)
    send = torch.ones(numel, device=device)
    recv = torch.empty(numel, device=device)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    progress("ring")
    timings = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prev)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        timings.append(time.perf_counter() - start)
    mine = torch.tensor([size_bytes / min(timings) / 1e9], device=device)
    gathered = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [{"src": r, "dst": (r + 1) % world, "gbps": float(g.item())} for r, g in enumerate(gathered)]


def matmul_gflops(device, seconds: float, size: int = 512) -> float:
    """Sustained matmul throughput of this rank over a fixed wall-clock window (so an outside slowdown shows)."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * count / (time.perf_counter() - start) / 1e9
