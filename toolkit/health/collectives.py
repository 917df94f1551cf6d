"""Collective sweeps with nccl-tests' bandwidth definitions and a correctness check, ring links, per-tier bandwidth.

algbw = S / t, with S the bytes nccl-tests reports for each op: the buffer of all_reduce and broadcast, the full
(gathered) array of all_gather and reduce_scatter, the bytes each rank sends for sendrecv; t the mean time of one op
(mean over timed iterations, then over ranks, as nccl-tests' default). busbw = algbw x the op's bus factor
(nccl-tests doc/PERFORMANCE.md; the same numbers as toolkit/estimate/comm.py BUS_FACTOR, which the planner uses),
so busbw is comparable to a link's unidirectional speed whatever the number of ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from toolkit.estimate.comm import BUS_FACTOR

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")
ELEMENT_BYTES = 4  # float32: exact small-integer patterns make every result checkable with ==
Progress = Callable[..., None]  # progress(step name, uniform=True): see toolkit/runtime/watchdog.py


def bus_factor(op: str, world: int) -> float:
    return BUS_FACTOR["p2p" if op == "sendrecv" else op](world)


def bandwidths(op: str, size_bytes: float, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) as nccl-tests defines them."""
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else float("inf")
    return algbw, algbw * bus_factor(op, world)


def element_count(op: str, size_bytes: int, world: int) -> int:
    """float32 elements of S, rounded down to a multiple of the world size where the op splits S across ranks."""
    numel = max(1, size_bytes // ELEMENT_BYTES)
    if op in ("all_gather", "reduce_scatter"):
        numel = max(world, numel // world * world)
    return numel


def ring_pair_phases(world: int) -> list[list[tuple[int, int]]]:
    """The ring's links r <-> r+1 in two or three phases of disjoint pairs, so each link is timed on its own."""
    if world < 2:
        return []
    if world == 2:
        return [[(0, 1)]]
    links = [(r, (r + 1) % world) for r in range(world)]
    if world % 2 == 0:
        return [links[0::2], links[1::2]]
    return [links[0 : world - 1 : 2], links[1::2], [links[-1]]]


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _prepare(op: str, numel: int, world: int, rank: int, device, group) -> tuple[Callable[[], None], Callable[[], bool]]:
    """(run once, check the result) for one op on fresh buffers holding a rank- and position-dependent pattern."""
    import torch
    import torch.distributed as dist

    pattern = lambda n, mod, start=0: torch.arange(start, start + n, device=device, dtype=torch.float32) % mod  # noqa: E731
    chunk = numel // world
    if op == "all_reduce":
        buffer = (pattern(numel, 7) + 1) * (rank + 1)
        expected = (pattern(numel, 7) + 1) * (world * (world + 1) // 2)

        def check() -> bool:
            ok = torch.equal(buffer, expected)
            buffer.zero_()  # the timed repeats then sum zeros: no overflow, no re-initialisation inside the timing
            return ok

        return (lambda: dist.all_reduce(buffer, group=group)), check
    if op == "all_gather":
        local = pattern(chunk, 5) + 10 * rank
        out = torch.empty(numel, device=device)
        expected = torch.cat([pattern(chunk, 5) + 10 * r for r in range(world)])
        return (lambda: dist.all_gather_into_tensor(out, local, group=group)), (lambda: torch.equal(out, expected))
    if op == "reduce_scatter":
        full = pattern(numel, 11) + rank
        out = torch.empty(chunk, device=device)
        expected = pattern(chunk, 11, rank * chunk) * world + world * (world - 1) // 2
        return (lambda: dist.reduce_scatter_tensor(out, full, group=group)), (lambda: torch.equal(out, expected))
    if op == "broadcast":
        root = dist.get_global_rank(group, 0) if group is not None else 0
        buffer = pattern(numel, 13) + 1 if rank == 0 else torch.zeros(numel, device=device)
        expected = pattern(numel, 13) + 1
        return (lambda: dist.broadcast(buffer, src=root, group=group)), (lambda: torch.equal(buffer, expected))
    if op == "sendrecv":  # nccl-tests sendrecv_perf: every rank sends to rank+1 while receiving from rank-1
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        return _exchange(numel, rank, nxt, prev, device, pattern)
    raise ValueError(f"unknown op {op}")


def _exchange(numel: int, rank: int, to: int, frm: int, device, pattern) -> tuple[Callable[[], None], Callable[[], bool]]:
    import torch
    import torch.distributed as dist

    send = pattern(numel, 3) + rank
    recv = torch.empty(numel, device=device)
    expected = pattern(numel, 3) + frm

    def run() -> None:
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, recv, frm)]):
            request.wait()

    return run, lambda: torch.equal(recv, expected)


def _timed(run: Callable[[], None], iters: int, device, group=None) -> float:
    """Mean seconds of one op over `iters` back-to-back runs, started together after a barrier."""
    import torch.distributed as dist

    _sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _all_ranks(values: list[float], device, op: str = "sum", group=None) -> list[float]:
    """Element-wise sum / min / max of a short float list over all ranks (one small all_reduce)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op],
                    group=group)
    return tensor.tolist()


def measure_op(op: str, size_bytes: int, iters: int, world: int, rank: int, device, group=None) -> dict:
    """One op at one size on `group` (rank and world inside it): checked once, then timed; same result on all ranks."""
    numel = element_count(op, size_bytes, world)
    run, check = _prepare(op, numel, world, rank, device, group)
    run()
    _sync(device)
    correct = check()
    seconds = _timed(run, iters, device, group)
    total_seconds, correct_everywhere = _all_ranks([seconds, 1.0 if correct else 0.0], device, "sum", group)
    mean_seconds, nbytes = total_seconds / world, numel * ELEMENT_BYTES
    algbw, busbw = bandwidths(op, nbytes, mean_seconds, world)
    return {"bytes": nbytes, "time_s": mean_seconds, "algbw_gbps": algbw, "busbw_gbps": busbw,
            "correct": correct_everywhere == world}


def sweep(sizes: tuple[int, ...], iters: int, world: int, rank: int, device, progress: Progress,
          results: dict | None = None) -> dict:
    """Every op at every size -> {op: {str(size): measure_op(...)}}; fills `results` as it goes (for a hang report)."""
    results = {} if results is None else results
    for op in OPS:
        for size in sizes:
            progress(f"{op} {size} B")
            results.setdefault(op, {})[str(size)] = measure_op(op, size, iters, world, rank, device)
    return results


def measure_links(world: int, rank: int, device, size_bytes: int, iters: int, progress: Progress) -> list[dict]:
    """GB/s of every ring link r <-> r+1 (both directions at once, GB/s per direction), each timed while no other
    pair of its phase shares a rank with it: a slow link shows on its own instead of slowing the whole ring."""
    import torch.distributed as dist

    phases = ring_pair_phases(world)
    links = [pair for phase in phases for pair in phase]
    seconds = [0.0] * len(links)
    numel = element_count("sendrecv", size_bytes, world)
    for index, phase in enumerate(phases):
        covered = len({r for pair in phase for r in pair}) == world  # then every rank issues the same ops
        progress(f"ring links, phase {index + 1}/{len(phases)}", uniform=covered)
        for pair in phase:
            if rank in pair:
                peer = pair[1] if rank == pair[0] else pair[0]
                run, check = _prepare_pair(numel, rank, peer, device)
                run()
                _sync(device)
                elapsed = _timed_pair(run, iters, device)
                seconds[links.index(pair)] = elapsed if check() else float("inf")
        dist.barrier()
    slowest = _all_ranks(seconds, device, "max")
    return [{"src": a, "dst": b, "gbps": numel * ELEMENT_BYTES / t / 1e9 if 0 < t < float("inf") else 0.0,
             "correct": t < float("inf")} for (a, b), t in zip(links, slowest, strict=True)]


def _prepare_pair(numel: int, rank: int, peer: int, device):
    import torch

    pattern = lambda n, mod, start=0: torch.arange(start, start + n, device=device, dtype=torch.float32) % mod  # noqa: E731
    return _exchange(numel, rank, peer, peer, device, pattern)


def _timed_pair(run: Callable[[], None], iters: int, device) -> float:
    """Fastest of `iters` exchanges: a bad link is slow on every try, a busy neighbour only on some."""
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def tier_bandwidths(hosts: list[str], rank: int, device, size_bytes: int, iters: int, progress: Progress) -> dict:
    """all_reduce busbw inside every node (its ranks) and across nodes (one rank per node), at one size.

    Returns {intra_node: {host: GB/s}, inter_node: GB/s or None}; every rank calls it (new_group is collective).
    """
    import torch.distributed as dist

    names = list(dict.fromkeys(hosts))
    members = {name: [r for r, h in enumerate(hosts) if h == name] for name in names}
    node_groups = {name: dist.new_group(members[name]) for name in names}
    leaders = [members[name][0] for name in names]
    cross = dist.new_group(leaders) if len(names) > 1 else None
    mine = members[hosts[rank]]
    progress("intra-node all_reduce", uniform=all(len(m) > 1 for m in members.values()))
    intra = None
    if len(mine) > 1:
        intra = measure_op("all_reduce", size_bytes, iters, len(mine), mine.index(rank), device, node_groups[hosts[rank]])
    dist.barrier()
    progress("inter-node all_reduce", uniform=len(leaders) == len(hosts))
    inter = None
    if cross is not None and rank in leaders:
        inter = measure_op("all_reduce", size_bytes, iters, len(leaders), leaders.index(rank), device, cross)
    dist.barrier()
    per_rank: list = [None] * len(hosts)
    dist.all_gather_object(per_rank, (intra["busbw_gbps"] if intra else None, inter["busbw_gbps"] if inter else None))
    intra_by_host = {hosts[r]: value[0] for r, value in enumerate(per_rank) if value[0] is not None and r in leaders}
    return {"intra_node": intra_by_host, "inter_node": per_rank[leaders[0]][1] if cross is not None else None}
