"""The `dmt health` report: thresholds (catalogue defaults, flags on top), the verdict, and its JSON schema.

JSON schema (`dmt health --json`; `dmt plan --measured-bw` reads `bandwidth`):
  ok             bool: healthy against every threshold; the exit code is 0 only then
  phase          "complete" | "hang" (a rank stopped moving) | "failure" (a rank died or a collective raised)
  world_size     int;  hosts: [str] distinct node names in rank order;  reported_by: rank that wrote it
  gpu            catalogue GPU the default thresholds came from, or null (CPU, or an unknown device)
  ranks          [{rank, host, pid, device, local_world_size, cpu_affinity ("0-3,8"), cpu_count, numa_nodes,
                   numa_node_count, env {NCCL_*, TORCH_NCCL_*, GLOO_*, ...}, matmul_ms, matmul_gflops, matmul_size,
                   matmul_dtype, memory_check (null = passed or not applicable), on GPUs also gpu_name, gpu_uuid,
                   gpu_serial, gpu_pci, gpu_numa_node, visible_devices, memory_bytes, matmul_fraction_of_peak}]
  collectives    {op: {size: {bytes, time_s, algbw_gbps, busbw_gbps, correct}}} for op in all_reduce, all_gather,
                   reduce_scatter, broadcast, sendrecv; size = the requested bytes as a string; bytes = S as
                   nccl-tests counts it; time_s = mean of one op; GB/s = 1e9 bytes/s
  bandwidth      {intra_node_busbw_gbps, inter_node_busbw_gbps, size_bytes, per_host_intra_node_busbw_gbps {host: v}}:
                   all_reduce busbw at the largest size, intra = the slowest node; null where not measured
                   (one rank per node, one node, one rank)
  links          [{src, dst, src_host, dst_host, tier ("intra"|"inter"), gbps, correct}]: ring links r <-> r+1
  slow_links     links judged slow, with median_gbps and why;  slow_nodes [{host, busbw_gbps, others_median_gbps}]
  suspects       [{rank (or null), host, why}]: what explains the slow links
  stragglers     [{rank, host, matmul_ms, others_median_ms, ratio}]
  unresponsive   [{rank, host, step, silent_s, reason}]: stopped, never started, or never arrived at a collective
  died           [{rank, host, how}]: exited or killed before the check finished
  problems       [str]: one line per failed check (empty when ok);  warnings [str]: worth a look, not failures
  thresholds     {straggler_factor, min_intra_busbw_gbps, min_inter_busbw_gbps, min_matmul_fraction, peak_gflops,
                   expected_devices (GPUs every rank must see: --expect-devices, else the ranks per node unless each
                   rank sees exactly one), deadline_s, source}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from toolkit.health import analysis

BUSBW_FRACTION = 0.5  # GPUs: fail below half the catalogue's link speed (nccl-tests reaches ~80-90% when healthy)


@dataclass(frozen=True)
class Thresholds:
    """What healthy means for this run. On CPU (gloo over loopback) no datasheet exists: no bandwidth or matmul
    floors unless given; correctness, liveness, stragglers and links that stand out from their peers still count."""

    straggler_factor: float
    min_intra_busbw_gbps: float | None
    min_inter_busbw_gbps: float | None
    min_matmul_fraction: float | None
    peak_gflops: float | None
    expected_devices: int | None
    deadline_s: float
    source: str


def thresholds_for(options, gpu, cuda: bool, local_world_size: int | None) -> Thresholds:
    """Catalogue defaults for `gpu` (a toolkit.spec.cluster.GPU, or None), overridden by the flags given."""
    intra = options.min_busbw_gbps
    inter = options.min_inter_busbw_gbps
    if gpu is not None:
        intra = intra if intra is not None else BUSBW_FRACTION * gpu.intra_node_bw_gbps
        inter = inter if inter is not None else BUSBW_FRACTION * gpu.inter_node_bw_gbps
    peak = gpu.peak_tflops.get("bf16", 0) * 1e3 if gpu is not None and cuda else None
    expected = options.expected_devices if options.expected_devices is not None else (local_world_size if cuda else None)
    source = f"catalogue {gpu.name}" if gpu is not None else ("cpu defaults" if not cuda else "no catalogue match")
    return Thresholds(straggler_factor=options.straggler_factor, min_intra_busbw_gbps=intra, min_inter_busbw_gbps=inter,
                      min_matmul_fraction=options.min_matmul_fraction if peak else None, peak_gflops=peak or None,
                      expected_devices=expected, deadline_s=options.deadline_s, source=source)


def resolve_gpu(options, ranks: list[dict]):
    """The catalogue GPU: --gpu, or the one the first GPU's name denotes; None on CPU or when unrecognised."""
    from toolkit.health.checks import match_gpu
    from toolkit.spec.cluster import get_gpu, load_catalogue

    if options.gpu:
        return get_gpu(options.gpu)
    names = [facts["gpu_name"] for facts in ranks if facts.get("gpu_name")]
    if not names:
        return None
    match = match_gpu(names[0], {name: gpu.name for name, gpu in load_catalogue().items()})
    return get_gpu(match) if match else None


def _rank_problems(ranks: list[dict], limits: Thresholds, options) -> tuple[list[str], list[str]]:
    problems, warnings = [], []
    for rank, facts in enumerate(ranks):
        who = f"rank {rank} ({facts['host']})"
        cuda = facts["device"].startswith("cuda")
        if not cuda and (options.gpu or options.expected_devices):
            problems.append(f"{who} sees no GPU")
        visible = facts.get("visible_devices")
        per_rank_binding = visible == 1 and options.expected_devices is None  # srun --gpus-per-task=1 and the like
        if cuda and limits.expected_devices is not None and visible != limits.expected_devices and not per_rank_binding:
            problems.append(f"{who} sees {visible} GPUs, expected {limits.expected_devices}")
        if facts.get("memory_check"):
            problems.append(f"{who}: {facts['memory_check']}")
        if cuda and limits.peak_gflops:
            fraction = facts["matmul_gflops"] / limits.peak_gflops
            facts["matmul_fraction_of_peak"] = fraction
            if fraction < limits.min_matmul_fraction:
                problems.append(f"{who}: matmul at {fraction:.0%} of the bf16 peak (threshold {limits.min_matmul_fraction:.0%})")
        numa = analysis.numa_mismatch(facts)
        if numa:
            warnings.append(f"{who}: {numa}")
    owners: dict[tuple, list[int]] = {}
    for rank, facts in enumerate(ranks):
        if facts.get("gpu_uuid"):
            owners.setdefault((facts["host"], facts["gpu_uuid"]), []).append(rank)
    problems += [f"ranks {', '.join(map(str, sharing))} on {host} share GPU {uuid}"
                 for (host, uuid), sharing in owners.items() if len(sharing) > 1]
    if len({facts.get("gpu_name") for facts in ranks}) > 1:
        warnings.append("ranks run different GPU models: " + ", ".join(sorted({str(f.get("gpu_name")) for f in ranks})))
    return problems, warnings + analysis.env_differences(ranks)


def judge(ranks: list[dict], collectives: dict, bandwidth: dict, links: list[dict], options) -> dict:
    """The full report of a run that completed on every rank."""
    cuda = any(facts["device"].startswith("cuda") for facts in ranks)
    gpu = resolve_gpu(options, ranks)
    limits = thresholds_for(options, gpu, cuda, ranks[0].get("local_world_size"))
    hosts = [facts["host"] for facts in ranks]
    problems, warnings = _rank_problems(ranks, limits, options)
    if cuda and gpu is None:
        warnings.append(f"GPU '{ranks[0].get('gpu_name')}' is not in the catalogue: no bandwidth or matmul floors "
                        "(pass --gpu or --min-busbw-gbps)")
    for op, by_size in collectives.items():
        problems += [f"{op} of {size} B returned wrong values" for size, row in by_size.items() if not row["correct"]]
    stragglers = analysis.find_stragglers([facts["matmul_ms"] for facts in ranks], hosts, limits.straggler_factor)
    problems += [f"rank {s['rank']} ({s['host']}) is a straggler: matmul {s['matmul_ms']:.2f} ms vs "
                 f"{s['others_median_ms']:.2f} ms median on the other ranks ({s['ratio']:.1f}x)" for s in stragglers]
    floors = {"intra": limits.min_intra_busbw_gbps, "inter": limits.min_inter_busbw_gbps}
    links = [{**link, "src_host": hosts[link["src"]], "dst_host": hosts[link["dst"]],
              "tier": analysis.link_tier(hosts, link["src"], link["dst"])} for link in links]
    slow_links = analysis.find_slow_links(links, hosts, limits.straggler_factor, floors)
    problems += [f"slow {s['tier']}-node link rank {s['src']} ({s['src_host']}) <-> rank {s['dst']} ({s['dst_host']}): "
                 f"{s['gbps']:.2f} GB/s, {s['why']}" for s in slow_links]
    suspects = analysis.find_suspects(links, slow_links, hosts)
    problems += [f"suspect {'rank ' + str(s['rank']) + ' on ' if s['rank'] is not None else 'node '}{s['host']}: {s['why']}"
                 for s in suspects]
    slow_nodes = analysis.find_slow_nodes(bandwidth.get("per_host_intra_node_busbw_gbps") or {},
                                          limits.straggler_factor, limits.min_intra_busbw_gbps)
    problems += [f"node {n['host']}: intra-node all_reduce busbw {n['busbw_gbps']:.1f} GB/s" for n in slow_nodes]
    intra, inter = bandwidth.get("intra_node_busbw_gbps"), bandwidth.get("inter_node_busbw_gbps")
    if limits.min_intra_busbw_gbps is not None and intra is not None and intra < limits.min_intra_busbw_gbps and not slow_nodes:
        problems.append(f"intra-node all_reduce busbw {intra:.2f} GB/s below the floor {limits.min_intra_busbw_gbps:g}")
    if limits.min_inter_busbw_gbps is not None and inter is not None and inter < limits.min_inter_busbw_gbps:
        problems.append(f"inter-node all_reduce busbw {inter:.2f} GB/s below the floor {limits.min_inter_busbw_gbps:g}")
    return {
        "ok": not problems, "phase": "complete", "world_size": len(ranks), "hosts": list(dict.fromkeys(hosts)),
        "gpu": gpu.name if gpu is not None else None,
        "ranks": [{"rank": rank, **facts} for rank, facts in enumerate(ranks)],
        "collectives": collectives, "bandwidth": bandwidth, "links": links, "slow_links": slow_links,
        "slow_nodes": slow_nodes, "suspects": suspects, "stragglers": stragglers, "unresponsive": [], "died": [],
        "problems": problems, "warnings": warnings, "thresholds": asdict(limits),
    }


def incomplete(world: int, hosts: list[str | None], phase: str, unresponsive: list[dict], died: list[dict],
               problems: list[str], collectives: dict | None = None) -> dict:
    """The report of a run that could not finish: who stopped, who died, and what was measured until then."""
    names = [h for h in dict.fromkeys(hosts) if h]
    lines = [f"rank {u['rank']} ({u.get('host') or '?'}) unresponsive for {u['silent_s']} s: {u['reason']} "
             f"(step '{u.get('step')}')" for u in unresponsive]
    lines += [f"rank {d['rank']} ({d.get('host') or '?'}) died: {d['how']}" for d in died]
    return {"ok": False, "phase": phase, "world_size": world, "hosts": names, "gpu": None, "ranks": [],
            "collectives": collectives or {},
            "bandwidth": {"intra_node_busbw_gbps": None, "inter_node_busbw_gbps": None, "size_bytes": None,
                          "per_host_intra_node_busbw_gbps": {}},
            "links": [], "slow_links": [], "slow_nodes": [], "suspects": [], "stragglers": [],
            "unresponsive": unresponsive, "died": died, "problems": lines + problems, "warnings": [], "thresholds": {}}


def add_deaths(report: dict, died: list[dict]) -> dict:
    """Fold in ranks a launcher saw exit (it knows the signal); they are no longer 'unresponsive'."""
    known = {d["rank"]: d for d in report.get("died", [])}
    for death in died:
        known[death["rank"]] = death
    dead = set(known)
    report["died"] = [known[rank] for rank in sorted(known)]
    report["unresponsive"] = [u for u in report.get("unresponsive", []) if u["rank"] not in dead]
    lines = [line for line in report.get("problems", []) if not any(line.startswith(f"rank {r} ") for r in dead)]
    report["problems"] = [f"rank {d['rank']} ({d.get('host') or '?'}) died: {d['how']}" for d in report["died"]] + lines
    report["ok"] = False
    return report
