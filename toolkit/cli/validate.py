"""`dmt validate FILE --world-size N [--model M] [--trainer-args FILE]`: check a DeepSpeed JSON before launching."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from toolkit.errors import UserInputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE", help="DeepSpeed JSON (generated or hand-written)")
    parser.add_argument("--world-size", type=int, required=True, help="processes the job will launch")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages of the model (DeepSpeed PipelineModule)")
    parser.add_argument("--trainer-args", type=Path, default=None, help="HF TrainingArguments as JSON (trainer_args.json)")
    parser.add_argument("--model", default=None, help="model for the memory-fit estimate")
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--seq-len", type=int, default=4096, help="sequence length for the memory-fit estimate")
    parser.add_argument("--recompute", choices=["none", "full"], default=None,
                        help="activation checkpointing for the estimate (default: the trainer arguments', else none)")
    parser.add_argument("--json", action="store_true")


def _read_json(path: Path, flag: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserInputError(flag, f"cannot read {path} as JSON ({exc})") from None


def memory_checker(model_source: str, world_size: int, gpu_name: str, seq_len: int, recompute: str):
    """A check of the config's plan against the GPU's memory, by the toolkit's memory model."""
    from toolkit.estimate.memory import estimate_memory
    from toolkit.spec.cluster import get_gpu
    from toolkit.spec.model import load_model_spec
    from toolkit.spec.plan import resolve_plan
    from toolkit.validate.deepspeed import Problem

    model, gpu = load_model_spec(model_source), get_gpu(gpu_name)

    def check(config: dict):
        zero = config.get("zero_optimization", {})
        precision = "bf16" if config.get("bf16", {}).get("enabled") else "fp16" if config.get("fp16", {}).get("enabled") else "fp32"
        micro = config.get("train_micro_batch_size_per_gpu", 1)
        plan = resolve_plan(
            model, world_size, zero=zero.get("stage", 0), micro_batch=micro, seq_len=seq_len, precision=precision,
            global_batch=config.get("train_batch_size"),
            offload_optimizer=(zero.get("offload_optimizer") or {}).get("device", "none"),
            offload_params=(zero.get("offload_param") or {}).get("device", "none"),
            nvme_path=(zero.get("offload_optimizer") or zero.get("offload_param") or {}).get("nvme_path"),
            recompute=recompute,
        )
        memory = estimate_memory(model, plan)
        if memory.total > gpu.memory_bytes:
            return Problem("memory", f"{memory.total / 2**30:.1f} GiB per GPU estimated for {model.name} at seq {seq_len}, "
                                     f"{gpu.name} has {gpu.memory_bytes / 2**30:.1f} GiB; raise the ZeRO stage, offload, "
                                     f"recompute or lower train_micro_batch_size_per_gpu")
        return None

    return check


def run(args: argparse.Namespace) -> int:
    from toolkit.validate.deepspeed import validate_deepspeed_config

    if args.world_size < 1:
        raise UserInputError("--world-size", f"must be positive, got {args.world_size}")
    config = _read_json(args.file, "FILE")
    trainer = _read_json(args.trainer_args, "--trainer-args") if args.trainer_args else None
    recompute = args.recompute or ("full" if (trainer or {}).get("gradient_checkpointing") else "none")
    check = memory_checker(args.model, args.world_size, args.gpu, args.seq_len, recompute) if args.model else None
    problems = validate_deepspeed_config(config, args.world_size, args.pp, trainer, check)
    if args.json:
        print(json.dumps({"ok": not problems, "problems": [{"key": p.key, "message": p.message} for p in problems]}))
    elif problems:
        for problem in problems:
            print(f"{args.file}: {problem}", file=sys.stderr)
    else:
        print(f"{args.file}: valid for world size {args.world_size}")
    return 2 if problems else 0
