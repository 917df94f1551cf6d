"""`dmt estimate`: parameter counts and the per-GPU memory breakdown of one model under one explicit plan."""

from __future__ import annotations

import argparse
import json

from toolkit.spec.plan import DEFAULTS

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
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                        help="DeepSpeed ZeRO stage (default 1 with deepspeed, 0 with megatron)")
    parser.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs --tp > 1)")
    parser.add_argument("--distributed-optimizer", action="store_true", help="Megatron distributed optimizer")
    parser.add_argument("--micro-batch", type=int, default=d["micro_batch"], help="per-GPU micro-batch (default 1)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default micro-batch x dp)")
    parser.add_argument("--seq-len", type=int, default=d["seq_len"], help="tokens per sequence (default %(default)s)")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default=d["recompute"])
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32", "fp8"], default=d["precision"])
    parser.add_argument("--attention", choices=["sdpa", "eager"], default=d["attention"],
                        help="sdpa: fused kernels that keep no s x s matrix (default); eager keeps the probabilities")
    parser.add_argument("--optimizer", choices=["adamw", "adamw8bit", "sgd"], default=d["optimizer"])
    parser.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default=d["offload_optimizer"])
    parser.add_argument("--offload-params", choices=["none", "cpu", "nvme"], default=d["offload_params"])
    parser.add_argument("--nvme-path", default=None, help="NVMe mount for nvme offload")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


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
        precision=args.precision,
        attention=args.attention,
        optimizer=args.optimizer,
        offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params,
        nvme_path=args.nvme_path,
    )


def estimate_report(args: argparse.Namespace) -> dict:
    """Everything `dmt estimate --json` prints, as a dict."""
    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.params import count_params
    from toolkit.spec.cluster import get_gpu
    from toolkit.spec.model import load_model_spec
    from toolkit.spec.plan import resolve_plan

    gpu = get_gpu(args.gpu)
    model = load_model_spec(args.model)
    plan = resolve_plan(model, args.gpus, **plan_options(args))
    counts = count_params(model)
    memory = estimate_memory(model, plan)
    return {
        "model": model.name,
        "family": model.family,
        "params": {"total": counts.total, "embedding": counts.embedding, "active": counts.active},
        "plan": plan.as_dict(),
        "gpu": gpu.name,
        "gpu_memory_bytes": gpu.memory_bytes,
        "memory_bytes": memory.as_dict(),
        "overhead_bytes": memory.overhead_detail,
        "host_memory_bytes_per_gpu": memory.host_bytes,
        "most_loaded_stage": memory.stage,
        "params_per_gpu": memory.params_on_gpu,
        "fits": memory.total <= gpu.memory_bytes,
    }


def run(args: argparse.Namespace) -> int:
    report = estimate_report(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    plan, mem, params = report["plan"], report["memory_bytes"], report["params"]
    console = Console()
    layout = " ".join(f"{k}={plan[k]}" for k in ("dp", "tp", "pp", "vpp", "cp", "ep"))
    console.print(
        f"[bold]{report['model']}[/] ({report['family']}): {params['total'] / 1e9:.3f}B params, "
        f"{params['active'] / 1e9:.3f}B active, {params['embedding'] / 1e9:.3f}B in embeddings"
    )
    console.print(
        f"{plan['backend']} on {plan['gpus']} x {report['gpu']}: {layout} zero={plan['zero']} "
        f"micro_batch={plan['micro_batch']} grad_accum={plan['grad_accum']} global_batch={plan['global_batch']} "
        f"seq_len={plan['seq_len']} recompute={plan['recompute']} {plan['precision']}"
    )
    table = Table(title=f"Per GPU, stage {report['most_loaded_stage']}", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    for key in ("weights", "gradients", "optimizer", "activations", "overhead"):
        table.add_row(key, f"{mem[key] / GiB:.2f}")
    table.add_row("[bold]total[/]", f"[bold]{mem['total'] / GiB:.2f}[/]")
    console.print(table)
    detail = ", ".join(f"{k} {v / GiB:.2f}" for k, v in report["overhead_bytes"].items())
    console.print(f"overhead: {detail} GiB")
    if report["host_memory_bytes_per_gpu"]:
        console.print(f"host RAM for offload: {report['host_memory_bytes_per_gpu'] / GiB:.2f} GiB per GPU")
    capacity = report["gpu_memory_bytes"] / GiB
    verdict = "[green]fits[/]" if report["fits"] else "[red]does not fit[/]"
    console.print(f"{verdict} in {capacity:.1f} GiB ({report['gpu']})")
