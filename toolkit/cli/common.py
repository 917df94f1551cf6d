"""Flags shared by the commands that take a model, a plan and a cluster, and their translation to library calls."""

from __future__ import annotations

import argparse

from toolkit.cli.options import add_plan_flags
from toolkit.cli.paths import path_arg, source_arg
from toolkit.errors import UserInputError
from toolkit.estimate.comm import Network
from toolkit.estimate.efficiency import HOST_GEMM_CEILING
from toolkit.numeric import bounded_int, is_finite_number, positive_float
from toolkit.readers import read_json
from toolkit.spec.backends import backend_of
from toolkit.spec.calibration import load_calibration
from toolkit.spec.cluster import DEFAULT_GPU, get_gpu, topology_defaults, with_host_memory
from toolkit.spec.options import default
from toolkit.spec.recipe import load_recipe, recipe_files


def add_plan_arguments(parser: argparse.ArgumentParser, *, required: tuple[str, ...] = ()) -> None:
    """The model, the cluster and every plan option, for the commands that take a model and a plan."""
    parser.add_argument("--model", type=source_arg, required=True,
                        help="preset name, HF config.json or directory, hub id, or toolkit YAML/JSON spec")
    parser.add_argument("--gpus", type=bounded_int, required=True, help="total GPUs")
    parser.add_argument("--gpu", default=DEFAULT_GPU, help="GPU from the catalogue (default %(default)s)")
    parser.add_argument("--host-memory-gb", type=positive_float, default=None, metavar="GB",
                        help="RAM of one node (GiB): plans whose offload needs more do not fit (default: not checked)")
    parser.add_argument("--max-seq-len", action="store_true",
                        help="find the longest sequence (a multiple of 1024) that fits, and what stops the next one")
    add_plan_flags(parser, required=required)


def plan_gpu(args: argparse.Namespace):
    """The catalogue's GPU the flags name, with the node RAM --host-memory-gb states."""
    return with_host_memory(get_gpu(args.gpu), args.host_memory_gb)


def check_max_seq_len(args: argparse.Namespace) -> None:
    """--max-seq-len searches the length: a --seq-len beside it is a contradiction, not a starting point."""
    if args.max_seq_len and args.seq_len is not None:
        raise UserInputError("--seq-len", "leave it out with --max-seq-len, which searches the sequence length")


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--intra-node-bw", type=positive_float, default=None, metavar="GBPS",
                        help="per-GPU bandwidth inside the NVLink domain (--nvlink-domain: a node, or an NVL72 rack) "
                             "in GB/s (default: the GPU catalogue's)")
    parser.add_argument("--inter-node-bw", type=positive_float, default=None, metavar="GBPS",
                        help="per-GPU bandwidth between NVLink domains in GB/s (default: the GPU catalogue's NIC, "
                             "at most the --network tier's own, ethernet 25)")
    parser.add_argument("--measured-bw", type=path_arg, default=None, metavar="HEALTH_JSON",
                        help="bus bandwidths measured by `dmt health --json` instead of datasheet numbers")
    add_calibration_argument(parser)


def add_calibration_argument(parser: argparse.ArgumentParser, what: str = "predictions") -> None:
    parser.add_argument("--calibration", type=path_arg, default=None, metavar="CALIBRATION_YAML",
                        help=f"{what} with the efficiencies and links `dmt calibrate` fitted to measured runs on this "
                             f"hardware")


def measured_links(path, flag: str) -> dict[str, float]:
    """The bus bandwidths a `dmt health --json` report measured: {"intra": GB/s, "inter": GB/s}, tiers it did not
    measure (one node: no inter-node link) left out."""
    report = read_json(path, flag, what="a `dmt health --json` report")
    bandwidth = report.get("bandwidth")
    if not isinstance(bandwidth, dict):
        raise UserInputError(flag, f"{path}: 'bandwidth' must be an object, as `dmt health --json` writes it")
    links = {}
    for tier, key in (("intra", "intra_node_busbw_gbps"), ("inter", "inter_node_busbw_gbps")):
        value = bandwidth.get(key)
        if value is None:  # that tier was not measured: the datasheet (or a calibration) stands
            continue
        if not is_finite_number(value) or value <= 0:
            raise UserInputError(flag, f"{path}: bandwidth.{key} must be a positive number of GB/s, or null (not "
                                       f"measured), got {value!r}")
        links[tier] = float(value)
    return links


def build_network(args: argparse.Namespace, gpu):
    """The Network a plan's communication runs over: catalogue, overridden by flags or a health report (a calibration's
    measured links then fill only the tiers these left alone, in step_time)."""
    intra, inter, measured = gpu.intra_node_bw_gbps, gpu.inter_node_bw_gbps, set()
    topology = topology_defaults(gpu, {"gpus_per_node": args.gpus_per_node, "nvlink_domain": args.nvlink_domain})
    gpus_per_node = topology.get("gpus_per_node") or default("gpus_per_node")
    if args.measured_bw is not None:
        links = measured_links(args.measured_bw, "--measured-bw")
        intra, inter = links.get("intra", intra), links.get("inter", inter)
        measured = set(links)
    given = set(measured) | {tier for tier, value in (("intra", args.intra_node_bw), ("inter", args.inter_node_bw))
                             if value is not None}
    intra = args.intra_node_bw or intra
    inter = args.inter_node_bw or inter
    return Network(intra_node_bw_gbps=intra, inter_node_bw_gbps=inter, gpus_per_node=gpus_per_node,
                   measured=frozenset(measured), given=frozenset(given), nvlink_domain=topology.get("nvlink_domain"),
                   scale_out=args.network or default("network"))


def calibration_for(path, gpu_name: str, key: str = "--calibration"):
    """The calibration file at `path` (None: none), checked to be one of this hardware."""
    if path is None:
        return None

    calibration = load_calibration(path, key)
    calibration.check_hardware(gpu_name, key)
    return calibration


def calibration_line(calibration: dict | None) -> str:
    """Whether a prediction used a calibration, and which: every output with a prediction says so. `calibration` is
    what records keep of it (Calibration.describe())."""
    if not calibration:
        return "uncalibrated: the published efficiency curve and catalogue figures (dmt calibrate fits them to runs)"
    fitted = ", ".join(f"{path} compute scale {value:.3g}" for path, value in calibration["compute_scale"].items())
    links = calibration.get("links") or {}
    measured = [f"{tier} {links[key]:g} GB/s" for tier, key in (("intra-node", "intra_node_busbw_gbps"),
                                                                 ("inter-node", "inter_node_busbw_gbps"))
                if links.get(key) is not None]
    extra = f"; measured links {', '.join(measured)}" if measured else ""
    fixed = {path: value for path, value in (calibration.get("fixed_step_s") or {}).items() if value}
    if fixed:
        extra += "; fixed per step " + ", ".join(f"{path} {value:.3g} s" for path, value in fixed.items())
    if calibration.get("host_peak_tflops"):
        extra += f"; {host_peak_text(calibration)}"
    return f"calibrated by {calibration['file']} ({calibration['hardware']}: {fitted}{extra})"


def host_peak_text(calibration: dict) -> str:
    """The host peak a calibration holds, and the load it was measured under against this host's now: a calibration
    taken on a busy machine and used on an idle one (or the other way round) says so."""
    import os

    peaks = ", ".join(f"{key} {value * 1e3:.1f} GFLOP/s" for key, value in calibration["host_peak_tflops"].items())
    how = calibration.get("host_peak")
    if not how:
        return f"host matmul peak {peaks}"
    now = os.getloadavg()[0]
    text = (f"host matmul peak {peaks} with {how['threads']} threads, measured at load {how['load_average']:.1f} "
            f"on {how['cores']} cores")
    if how.get("raised_by", 1) > 1:
        text += (f" and raised {how['raised_by']:.3g}x, so that the runs' GEMMs reach at most "
                 f"{HOST_GEMM_CEILING:.0%} of it")
    if abs(now - how["load_average"]) >= max(1.0, how["cores"] / 2):
        text += (f"; this host's load is {now:.1f} now, so its step times differ from the calibration's by what that "
                 f"load takes")
    return text


def sharding_text(plan) -> str:
    """How a plan (a Plan) shards model states: `zero=2`, or FSDP2's shard and replica groups."""
    return backend_of(plan).search.sharding_text(plan)


def rendered_from(args: argparse.Namespace) -> list:
    """What a rendered script or manifest is made from besides its flags: the recipe's files, and the generated
    directory of --plan (its deepspeed.json, accelerate.yaml, ...), none of which --out may replace."""
    plan = [] if args.plan is None else [args.plan if args.plan.is_dir() else args.plan.parent]
    return [*recipe_files(load_recipe(args.recipe)), *plan]
