"""`dmt convert`: checkpoint conversion between DeepSpeed ZeRO, FSDP2 (DCP), HF safetensors and Megatron-Core
layouts, and LoRA adapters merged into their base."""

from __future__ import annotations

import argparse
from pathlib import Path

from toolkit.cli.paths import output_arg, path_arg
from toolkit.numeric import bounded_int, finite_float, json_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True, parser_class=type(parser))
    zero = sub.add_parser("zero-to-hf", help="DeepSpeed ZeRO 1/2/3 checkpoint -> HF safetensors + config",
                          description="Stream a DeepSpeed ZeRO checkpoint (HF Trainer or bare DeepSpeed layout, any "
                                      "world size) into HF safetensors; equal bit for bit to DeepSpeed's zero_to_fp32.")
    zero.add_argument("ckpt_dir", type=path_arg, metavar="CKPT_DIR", help="directory with `latest` (or the tag directory)")
    zero.add_argument("out_dir", type=output_arg, metavar="OUT_DIR", help="new directory for the HF model")
    zero.add_argument("--tag", default=None, help="checkpoint tag, e.g. global_step100 (default: from `latest`)")
    zero.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    zero.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default %(default)s)")
    zero.add_argument("--config", type=path_arg, default=None, help="HF config.json when the checkpoint has none beside it")
    zero.add_argument("--json", action="store_true", help="print the result as one JSON object")

    to_mcore = sub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron-Core dist checkpoint",
                              description="Write a Megatron-Core dist checkpoint (torch_dist) of an HF model that a "
                                          "GPTModel at this TP/PP/VPP/EP loads (and, resharded, other layouts).")
    to_mcore.add_argument("hf_dir", type=path_arg, metavar="HF_DIR")
    to_mcore.add_argument("out_dir", type=output_arg, metavar="OUT_DIR", help="new directory for the dist checkpoint")
    for flag, what in (("tp", "tensor"), ("pp", "pipeline"), ("vpp", "virtual pipeline"), ("ep", "expert")):
        to_mcore.add_argument(f"--{flag}", type=bounded_int, default=1, help=f"{what} parallel size it is meant for")
    to_mcore.add_argument("--check", action="store_true", help="then compare logits with the HF model at --tp/--pp")
    to_mcore.add_argument("--json", action="store_true", help="print the result as one JSON object")

    to_hf = sub.add_parser("megatron-to-hf", help="Megatron-Core dist checkpoint -> HF safetensors + config",
                           description="Read a Megatron-Core dist checkpoint (converted or saved by training, any "
                                       "layout) back into HF safetensors.")
    to_hf.add_argument("megatron_dir", type=path_arg, metavar="MEGATRON_DIR")
    to_hf.add_argument("out_dir", type=output_arg, metavar="OUT_DIR", help="new directory for the HF model")
    to_hf.add_argument("--config", type=path_arg, default=None, help="HF config.json when the checkpoint has none")
    to_hf.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (HF's max_shard_size)")
    to_hf.add_argument("--json", action="store_true", help="print the result as one JSON object")

    fsdp = sub.add_parser("fsdp-to-hf", help="FSDP2 sharded checkpoint (DCP) -> HF safetensors + config",
                          description="Stream an Accelerate FSDP2 SHARDED_STATE_DICT checkpoint (a Trainer "
                                      "checkpoint-N or its pytorch_model_fsdp_0/, saved by any number of ranks) into "
                                      "HF safetensors, tensor by tensor; equal bit for bit to `accelerate "
                                      "merge-weights`.")
    fsdp.add_argument("ckpt_dir", type=path_arg, metavar="CKPT", help="checkpoint-N, or its pytorch_model_fsdp_0/")
    fsdp.add_argument("out_dir", type=output_arg, metavar="OUT_DIR", help="new directory for the HF model")
    fsdp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    fsdp.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default %(default)s)")
    fsdp.add_argument("--config", type=path_arg, default=None,
                      help="HF config.json when the checkpoint has none beside it")
    fsdp.add_argument("--json", action="store_true", help="print the result as one JSON object")

    merge = sub.add_parser("merge-lora", help="LoRA adapter + its base -> merged HF safetensors",
                           description="Merge a PEFT LoRA adapter (adapter_model.safetensors + adapter_config.json, a "
                                       "training checkpoint-N holds them) into its HF base, tensor by tensor; equal "
                                       "bit for bit to PEFT's merge_and_unload() of the base as stored.")
    merge.add_argument("base_dir", type=path_arg, metavar="BASE", help="the HF base model directory (safetensors)")
    merge.add_argument("adapter_dir", type=path_arg, metavar="ADAPTER", help="the adapter directory (or checkpoint-N)")
    merge.add_argument("out_dir", type=output_arg, metavar="OUT_DIR", help="new directory for the merged model")
    merge.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default %(default)s)")
    merge.add_argument("--json", action="store_true", help="print the result as one JSON object")

    check = sub.add_parser("check", help="max logit difference of an HF model and a Megatron-Core checkpoint",
                           description="Run the HF model and the Megatron-Core model of the checkpoint (at --tp/--pp, "
                                       "under torchrun when more than one process) on the same tokens.")
    check.add_argument("hf_dir", type=path_arg, metavar="HF_DIR")
    check.add_argument("megatron_dir", type=path_arg, metavar="MEGATRON_DIR")
    check.add_argument("--tp", type=bounded_int, default=1)
    check.add_argument("--pp", type=bounded_int, default=1)
    check.add_argument("--tolerance", type=finite_float, default=1e-4, help="largest max-abs logit difference that passes")
    check.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    handlers = {"zero-to-hf": _zero_to_hf, "hf-to-megatron": _hf_to_megatron, "megatron-to-hf": _megatron_to_hf,
                "fsdp-to-hf": _fsdp_to_hf, "merge-lora": _merge_lora, "check": _check}
    if getattr(args, "out_dir", None) is not None:  # before any input is read: never one of them, never a full one
        from toolkit.checkpoint.atomic import check_output_dir

        check_output_dir(args.out_dir)
    return handlers[args.direction](args)


def _zero_to_hf(args: argparse.Namespace) -> int:
    import sys

    from toolkit.checkpoint.zero_to_hf import convert_zero_to_hf

    result = convert_zero_to_hf(args.ckpt_dir, args.out_dir, tag=args.tag, dtype=args.dtype,
                                max_shard_size=args.max_shard_size, config=args.config, progress=sys.stderr.isatty())
    summary = {"out_dir": str(result.out_dir), "tensors": result.tensors, "bytes": result.bytes_written,
               "shards": result.shards, "zero_stage": result.stage, "world_size": result.world_size}
    if args.json:
        print(json_text(summary))
    else:
        print(f"ZeRO-{result.stage} checkpoint of {result.world_size} ranks -> {result.out_dir}: "
              f"{result.tensors} tensors, {result.bytes_written / 2**20:.1f} MiB in {result.shards} shard(s)")
    return 0


def _interactive() -> bool:
    import sys

    return sys.stderr.isatty()


def _print(args: argparse.Namespace, summary: dict, line: str) -> None:
    import json

    print(json_text(summary) if args.json else line)


def _check_report(args: argparse.Namespace, hf_dir: Path, ckpt: Path, tp: int, pp: int, tolerance: float = 1e-4) -> int:
    from toolkit.checkpoint.megatron_check import run_check

    result = run_check(hf_dir, ckpt, tp=tp, pp=pp, tolerance=tolerance)
    summary = {"max_abs_diff": result.max_abs_diff, "logit_scale": result.logit_scale, "tolerance": tolerance,
               "tp": tp, "pp": pp, "passed": result.passed}
    verdict = "passed" if result.passed else "FAILED"
    _print(args, summary, f"logits at tp={tp} pp={pp}: max abs difference {result.max_abs_diff:.3g} (logits up to "
                          f"{result.logit_scale:.3g}, tolerance {tolerance:g}): {verdict}")
    return 0 if result.passed else 1


def _hf_to_megatron(args: argparse.Namespace) -> int:
    from toolkit.checkpoint.megatron_hf import hf_to_megatron

    result = hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
                            progress=_interactive())
    summary = {"out_dir": str(result.out_dir), "tensors": result.tensors, "parameters": result.parameters,
               "layout": result.layout, "padded_vocab": result.padded_vocab}
    if not args.check:
        _print(args, summary, f"{args.hf_dir} -> {result.out_dir}: {result.tensors} tensors, {result.parameters:,} "
                              f"parameters, vocabulary padded to {result.padded_vocab} for tp={args.tp}")
        return 0
    if not args.json:
        print(f"{args.hf_dir} -> {result.out_dir}: {result.tensors} tensors, {result.parameters:,} parameters")
    return _check_report(args, args.hf_dir, args.out_dir, args.tp, args.pp)


def _megatron_to_hf(args: argparse.Namespace) -> int:
    from toolkit.checkpoint.megatron_hf import megatron_to_hf

    summary = megatron_to_hf(args.megatron_dir, args.out_dir, config=args.config, dtype=args.dtype,
                             progress=_interactive(), max_shard_size=args.max_shard_size)
    _print(args, summary, f"{args.megatron_dir} -> {summary['out_dir']}: {summary['tensors']} tensors, "
                          f"{summary['parameters']:,} parameters")
    return 0


def _fsdp_to_hf(args: argparse.Namespace) -> int:
    from toolkit.checkpoint.fsdp_to_hf import convert_fsdp_to_hf

    summary = convert_fsdp_to_hf(args.ckpt_dir, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                 config=args.config, progress=_interactive())
    _print(args, summary, f"FSDP2 checkpoint of {summary['rank_files']} rank file(s) -> {summary['out_dir']}: "
                          f"{summary['tensors']} tensors, {summary['parameters']:,} parameters, "
                          f"{summary['bytes'] / 2**20:.1f} MiB in {summary['shards']} shard(s)")
    return 0


def _merge_lora(args: argparse.Namespace) -> int:
    from toolkit.checkpoint.merge_lora import merge_lora

    summary = merge_lora(args.base_dir, args.adapter_dir, args.out_dir, max_shard_size=args.max_shard_size)
    _print(args, summary, f"{args.adapter_dir} merged into {args.base_dir} -> {summary['out_dir']}: "
                          f"{summary['merged']} of {summary['tensors']} tensors adapted (scaling "
                          f"{summary['scaling']:g}), {summary['shards']} shard(s)")
    return 0


def _check(args: argparse.Namespace) -> int:
    return _check_report(args, args.hf_dir, args.megatron_dir, args.tp, args.pp, args.tolerance)
