"""Judge the measurements against thresholds and build the report (`dmt health --json`).

Report schema: ok (bool), world_size, hosts, ranks (per-rank facts: host, pid, device, affinity, NCCL env,
matmul_gflops, ...), collectives {op: {size_bytes: {time_s, algbw_gbps, busbw_gbps, correct}}}, bandwidth
{intra_node_busbw_gbps, inter_node_busbw_gbps} (all_reduce at the largest size; null when not measured; this is what
`dmt plan --measured-bw` reads), links (ring p2p GB/s per rank -> rank+1), stragglers, unresponsive, died, problems
(one line each), thresholds.
"""

from __future__ import annotations

import statistics

# CPU ranks (gloo over loopback) have no datasheet to hold them to: only correctness, liveness, stragglers count.
GPU_BUSBW_FRACTION = 0.5  # on GPUs: fail below half the catalogue's link speed


def _busbw_threshold(options) -> float | None:
    if options.min_busbw_gbps is not None:
        return options.min_busbw_gbps
    if options.gpu:
        from toolkit.spec.cluster import get_gpu

        return GPU_BUSBW_FRACTION * get_gpu(options.gpu).intra_node_bw_gbps
    return None


def judge(ranks: list[dict], results: dict, links: list[dict], intra, inter, options) -> dict:
    problems: list[str] = []
    for op, by_size in results.items():
        for size, row in by_size.items():
            if not row["correct"]:
                problems.append(f"{op} of {size} bytes returned wrong values")
    for rank, facts in enumerate(ranks):
        if facts.get("memory_problem"):
            problems.append(f"rank {rank} ({facts['host']}): {facts['memory_problem']}")
        visible = facts.get("visible_devices")
        if options.expected_devices is not None and visible is not None and visible != options.expected_devices:
            problems.append(f"rank {rank} ({facts['host']}) sees {visible} GPUs, expected {options.expected_devices}")
    speeds = [facts["matmul_gflops"] for facts in ranks]
    stragglers = []
    for rank, speed in enumerate(speeds):  # against the median of the other ranks, so it works with two ranks too
        others = statistics.median(speeds[:rank] + speeds[rank + 1:]) if len(speeds) > 1 else speed
        if speed * options.straggler_factor < others:
            stragglers.append({"rank": rank, "host": ranks[rank]["host"], "matmul_gflops": speed, "others_median_gflops": others})
    problems += [f"rank {s['rank']} ({s['host']}) is a straggler: {s['matmul_gflops']:.1f} GFLOP/s vs "
                 f"{s['others_median_gflops']:.1f} on the other ranks" for s in stragglers]
    if links:
        for index, link in enumerate(links):
            rest = [other["gbps"] for i, other in enumerate(links) if i != index]
            link_median = statistics.median(rest) if rest else link["gbps"]
            if link["gbps"] * options.straggler_factor < link_median:
                problems.append(f"slow link rank {link['src']} ({ranks[link['src']]['host']}) -> rank {link['dst']} "
                                f"({ranks[link['dst']]['host']}): {link['gbps']:.2f} GB/s vs median {link_median:.2f}")
    threshold = _busbw_threshold(options)
    if threshold is not None and intra is not None and intra < threshold:
        problems.append(f"intra-node all_reduce busbw {intra:.1f} GB/s below the threshold {threshold:.1f}")
    return {
        "ok": not problems,
        "world_size": len(ranks),
        "hosts": sorted({facts["host"] for facts in ranks}),
        "ranks": ranks,
        "collectives": results,
        "bandwidth": {"intra_node_busbw_gbps": intra, "inter_node_busbw_gbps": inter},
        "links": links,
        "stragglers": stragglers,
        "unresponsive": [],
        "died": [],
        "problems": problems,
        "thresholds": {"straggler_factor": options.straggler_factor, "min_busbw_gbps": threshold,
                       "deadline_s": options.deadline_s},
    }
