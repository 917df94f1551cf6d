"""Flags shared by the commands that take a model, a plan and a cluster, and their translation to library calls."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.spec.plan import DEFAULTS, TRANSFORMER_IMPLS

GiB = 1024**3


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that takes a model and a plan."""
    d = DEFAULTS
    parser.add_argument("--model", required=True, help="preset name, HF config.json or directory, hub id, or toolkit YAML/JSON spec")
    parser.add_argument("--gpus", type=int, required=True, help="total GPUs")
    parser.add_argument("--gpus-per-node", type=int, default=d["gpus_per_node"], help="default %(default)s")
    parser.add_argument("--gpu", default=d["gpu"], help="GPU from the catalogue (default %(default)s)")
    parser.add_argument("--backend", choices=["deepspeed", "megatron"], default=d["backend"])
    for flag in ("tp", "pp", "vpp", "cp", "ep"):
        parser.add_argument(f"--{flag}", type=int, default=d[flag], help=f"{flag.upper()} size (default 1)")
    parser.add_argument("--first-stage-layers", type=int, default=None,
                        help="Megatron uneven pipeline split: layers on the first stage (the rest split evenly)")
    parser.add_argument("--last-stage-layers", type=int, default=None, help="likewise for the last stage")
    parser.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                        help="Megatron: count the embedding as a layer of the first stage (Llama 3 405B's split)")
    parser.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                        help="Megatron: count the output layer and loss as a layer of the last stage")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                        help="DeepSpeed ZeRO stage (default 1 with deepspeed, 0 with megatron)")
    parser.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs --tp > 1)")
    parser.add_argument("--distributed-optimizer", action="store_true", help="Megatron distributed optimizer")
    parser.add_argument("--micro-batch", type=int, default=d["micro_batch"], help="per-GPU micro-batch (default 1)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default micro-batch x dp)")
    parser.add_argument("--seq-len", type=int, default=d["seq_len"], help="tokens per sequence (default %(default)s)")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default=d["recompute"])
    parser.add_argument("--recompute-modules", default=None, metavar="core_attn,mlp",
                        help="Megatron selective recompute: modules to recompute (default core_attn)")
    parser.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                        help="Megatron full recompute, block method: the first N layers of each model chunk "
                             "(default: every layer)")
    parser.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default=None,
                        help="Megatron layer modules: Transformer Engine's fused ones (default) or Megatron-Core's "
                             "own (unfused attention and SwiGLU: more activation memory)")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32", "fp8"], default=d["precision"])
    parser.add_argument("--attention", choices=["sdpa", "eager"], default=d["attention"],
                        help="sdpa: fused kernels that keep no s x s matrix (default); eager keeps the probabilities")
    parser.add_argument("--optimizer", choices=["adamw", "adamw8bit", "sgd"], default=d["optimizer"])
    parser.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default=d["offload_optimizer"])
    parser.add_argument("--offload-params", choices=["none", "cpu", "nvme"], default=d["offload_params"])
    parser.add_argument("--nvme-path", default=None, help="NVMe mount for nvme offload")


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--intra-node-bw", type=float, default=None, metavar="GBPS",
                        help="per-GPU bandwidth inside a node in GB/s (default: the GPU catalogue's)")
    parser.add_argument("--inter-node-bw", type=float, default=None, metavar="GBPS",
                        help="per-GPU bandwidth across nodes in GB/s (default: the GPU catalogue's)")
    parser.add_argument("--measured-bw", type=Path, default=None, metavar="HEALTH_JSON",
                        help="bus bandwidths measured by `dmt health --json` instead of datasheet numbers")


def build_network(args: argparse.Namespace, gpu):
    """The Network a plan's communication runs over: catalogue, overridden by flags or a health report."""
    from toolkit.estimate.comm import Network

    intra, inter, measured = gpu.intra_node_bw_gbps, gpu.inter_node_bw_gbps, False
    if args.measured_bw is not None:
        try:
            bandwidth = json.loads(args.measured_bw.read_text())["bandwidth"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserInputError("--measured-bw", f"{args.measured_bw} is not a `dmt health --json` report ({exc})") from None
        if not isinstance(bandwidth, dict):
            raise UserInputError("--measured-bw", f"{args.measured_bw}: 'bandwidth' must be an object")
        for key in ("intra_node_busbw_gbps", "inter_node_busbw_gbps"):
            value = bandwidth.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise UserInputError("--measured-bw", f"{args.measured_bw}: bandwidth.{key} must be a number of GB/s "
                                                      f"or null (not measured), got {value!r}")
        intra = bandwidth.get("intra_node_busbw_gbps") or intra
        inter = bandwidth.get("inter_node_busbw_gbps") or inter
        measured = True
    for flag, value in (("--intra-node-bw", args.intra_node_bw), ("--inter-node-bw", args.inter_node_bw)):
        if value is not None and value <= 0:
            raise UserInputError(flag, f"must be a positive bandwidth in GB/s, got {value}")
    intra = args.intra_node_bw or intra
    inter = args.inter_node_bw or inter
    return Network(intra_node_bw_gbps=intra, inter_node_bw_gbps=inter, gpus_per_node=args.gpus_per_node, measured=measured)


def plan_options(args: argparse.Namespace) -> dict:
    return dict(
        gpus_per_node=args.gpus_per_node,
        backend=args.backend,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        zero=args.zero,
        sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.distributed_optimizer,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        recompute=args.recompute,
        recompute_modules=args.recompute_modules,
        recompute_num_layers=args.recompute_num_layers,
        transformer_impl=args.transformer_impl,
        precision=args.precision,
        attention=args.attention,
        optimizer=args.optimizer,
        offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params,
        nvme_path=args.nvme_path,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
    )
