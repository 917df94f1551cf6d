"""The `dmt health` verdict: thresholds (catalogue defaults, flags on top), the judgement, and the health verdict as
typed models.

`dmt health --json` prints HealthReport.as_json(); `dmt plan --measured-bw` reads its `bandwidth`. The JSON keys are a
contract (scripts and `dmt plan` read them): a field is added here, never renamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_serializer

from toolkit.health import analysis
from toolkit.health.checks import match_gpu
from toolkit.spec.cluster import get_gpu, load_catalogue

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
    """GPUs every rank must see: --expect-devices, else the ranks per node unless each rank sees exactly one."""
    deadline_s: float
    source: str


class _Part(BaseModel):
    """A part of the health verdict. Keys in `only_when_given` are written only when the code that built it set them
    (a GPU's facts on a GPU rank, `reported_by` on a verdict one rank wrote), so a null written is a null measured."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    only_when_given: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _leave_out_what_was_not_given(self, handler):
        data = handler(self)
        for name in self.only_when_given:
            if name not in self.model_fields_set:
                data.pop(name, None)
        return self._written(data)

    def _written(self, data: dict) -> dict:
        return data

    def as_json(self) -> dict:
        """This part as JSON types, keys in the order of the fields."""
        return self.model_dump(mode="json")


class RankFacts(_Part):
    """What one rank measured and saw (toolkit/health/checks.py host_facts, memory_check; matmul_benchmark)."""

    only_when_given = ("gpu_name", "gpu_uuid", "visible_devices", "memory_bytes", "gpu_serial", "gpu_pci",
                       "gpu_numa_node", "matmul_fraction_of_peak", "pid", "cpu_affinity", "cpu_count", "numa_nodes",
                       "numa_node_count", "local_world_size", "memory_check", "matmul_size", "matmul_dtype")

    rank: int
    host: str
    pid: int | None = None
    device: str
    cpu_affinity: str | None = None
    """The CPUs this rank may run on, as taskset prints them: "0-3,8"."""
    cpu_count: int | None = None
    numa_nodes: list[int] | None = None
    numa_node_count: int | None = None
    env: dict[str, str] = {}
    """NCCL_*, TORCH_NCCL_*, GLOO_*, ... as this rank saw them."""
    gpu_name: str | None = None
    gpu_uuid: str | None = None
    visible_devices: int | None = None
    memory_bytes: int | None = None
    gpu_serial: str | None = None
    gpu_pci: str | None = None
    gpu_numa_node: int | None = None
    local_world_size: int | None = None
    memory_check: str | None = None
    """The failed allocation in one line; null: passed, or not applicable (CPU)."""
    matmul_ms: float
    matmul_gflops: float
    matmul_size: int | None = None
    matmul_dtype: str | None = None
    matmul_fraction_of_peak: float | None = None


class Collective(_Part):
    """One op at one size: `bytes` is S as nccl-tests counts it; time_s the mean of one op; GB/s = 1e9 bytes/s."""

    bytes: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float
    correct: bool


class Bandwidth(_Part):
    """all_reduce busbw at the largest size, intra = the slowest node; null where not measured (one rank per node,
    one node, one rank)."""

    intra_node_busbw_gbps: float | None = None
    inter_node_busbw_gbps: float | None = None
    size_bytes: int | None = None
    per_host_intra_node_busbw_gbps: dict[str, float] = {}


class Link(_Part):
    """A ring link r <-> r+1 (collectives.measure_links); a slow one also says why (analysis.find_slow_links)."""

    only_when_given = ("median_gbps", "why")

    src: int
    dst: int
    gbps: float
    correct: bool = True
    src_host: str
    dst_host: str
    tier: Literal["intra", "inter"]
    median_gbps: float | None = None
    why: str | None = None


class SlowNode(_Part):
    host: str
    busbw_gbps: float
    others_median_gbps: float | None
    floor_gbps: float | None


class Suspect(_Part):
    """What explains the slow links: a rank (both its ring links slow) or a node (rank null)."""

    rank: int | None
    host: str
    why: str


class Straggler(_Part):
    rank: int
    host: str
    matmul_ms: float
    others_median_ms: float
    ratio: float


class Unresponsive(_Part):
    """Stopped, never started, or never arrived at a collective (toolkit/runtime/watchdog.py find_unresponsive)."""

    rank: int
    host: str | None
    step: str | None = None
    silent_s: float
    reason: str


class Died(_Part):
    """Exited or killed before the check finished."""

    rank: int
    host: str | None
    how: str


class HealthReport(_Part):
    """The verdict of one `dmt health` run (`--json`, `--output`); `ok` decides the exit code (0 only when ok)."""

    only_when_given = ("reported_by",)

    ok: bool
    phase: Literal["complete", "hang", "failure"]
    """complete; hang: a rank stopped moving; failure: a rank died or a collective raised."""
    world_size: int
    hosts: list[str]
    """Distinct node names in rank order."""
    gpu: str | None = None
    """The catalogue GPU the default thresholds came from; null on CPU or for an unknown device."""
    ranks: list[RankFacts] = []
    collectives: dict[str, dict[str, Collective]] = {}
    """{op: {requested size in bytes as a string: the op at that size}} for op in collectives.OPS."""
    bandwidth: Bandwidth = Bandwidth()
    links: list[Link] = []
    slow_links: list[Link] = []
    slow_nodes: list[SlowNode] = []
    suspects: list[Suspect] = []
    stragglers: list[Straggler] = []
    unresponsive: list[Unresponsive] = []
    died: list[Died] = []
    problems: list[str] = []
    """One line per failed check (empty when ok)."""
    warnings: list[str] = []
    """Worth a look, not failures."""
    thresholds: Thresholds | None = None
    """What healthy meant for this run; {} in the JSON of a run that could not finish."""
    reported_by: int | None = None
    """The rank that wrote it; absent when the spawning `dmt health --nproc` wrote it (no rank could)."""

    @field_validator("thresholds", mode="before")
    @classmethod
    def _none_when_empty(cls, value: Any) -> Any:
        return None if value == {} else value

    def _written(self, data: dict) -> dict:
        if data.get("thresholds") is None:
            data["thresholds"] = {}
        return data


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


def judge(ranks: list[dict], collectives: dict, bandwidth: dict, links: list[dict], options) -> HealthReport:
    """The full verdict of a run that completed on every rank."""
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
    # named by its term, as `dmt report --breakdown` names a training run's slowest rank (a preflight measures compute)
    problems += [f"rank {s['rank']} ({s['host']}) is a straggler by compute: matmul {s['matmul_ms']:.2f} ms vs "
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
    return HealthReport(
        ok=not problems, phase="complete", world_size=len(ranks), hosts=list(dict.fromkeys(hosts)),
        gpu=gpu.name if gpu is not None else None, ranks=[{"rank": rank, **facts} for rank, facts in enumerate(ranks)],
        collectives=collectives, bandwidth=bandwidth, links=links, slow_links=slow_links, slow_nodes=slow_nodes,
        suspects=suspects, stragglers=stragglers, problems=problems, warnings=warnings, thresholds=limits)


def incomplete(world: int, hosts: list[str | None], phase: str, unresponsive: list[dict], died: list[dict],
               problems: list[str], collectives: dict | None = None) -> HealthReport:
    """The verdict of a run that could not finish: who stopped, who died, and what was measured until then."""
    lines = [f"rank {u['rank']} ({u.get('host') or '?'}) unresponsive for {u['silent_s']} s: {u['reason']} "
             f"(step '{u.get('step')}')" for u in unresponsive]
    lines += [f"rank {d['rank']} ({d.get('host') or '?'}) died: {d['how']}" for d in died]
    return HealthReport(ok=False, phase=phase, world_size=world, hosts=[h for h in dict.fromkeys(hosts) if h],
                        collectives=collectives or {}, unresponsive=unresponsive, died=died, problems=lines + problems)


def add_deaths(report: HealthReport, died: list[dict]) -> HealthReport:
    """Fold in ranks a launcher saw exit (it knows the signal); they are no longer 'unresponsive'."""
    known = {d.rank: d for d in report.died} | {d["rank"]: Died(**d) for d in died}
    dead = set(known)
    lines = [line for line in report.problems if not any(line.startswith(f"rank {r} ") for r in dead)]
    deaths = [known[rank] for rank in sorted(known)]
    return report.model_copy(update={
        "ok": False, "died": deaths, "unresponsive": [u for u in report.unresponsive if u.rank not in dead],
        "problems": [f"rank {d.rank} ({d.host or '?'}) died: {d.how}" for d in deaths] + lines})
