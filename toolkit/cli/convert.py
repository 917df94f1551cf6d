"""`dmt convert`: checkpoint conversion between DeepSpeed ZeRO, HF safetensors and Megatron-Core layouts."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True, parser_class=type(parser))
    zero = sub.add_parser("zero-to-hf", help="DeepSpeed ZeRO 1/2/3 checkpoint -> HF safetensors + config",
                          description="Stream a DeepSpeed ZeRO checkpoint (HF Trainer or bare DeepSpeed layout, any "
                                      "world size) into HF safetensors; equal bit for bit to DeepSpeed's zero_to_fp32.")
    zero.add_argument("ckpt_dir", type=Path, metavar="CKPT_DIR", help="directory with `latest` (or the tag directory)")
    zero.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="new directory for the HF model")
    zero.add_argument("--tag", default=None, help="checkpoint tag, e.g. global_step100 (default: from `latest`)")
    zero.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    zero.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default %(default)s)")
    zero.add_argument("--config", type=Path, default=None, help="HF config.json when the checkpoint has none beside it")
    zero.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.direction == "zero-to-hf":
        return _zero_to_hf(args)
    raise AssertionError(args.direction)


def _zero_to_hf(args: argparse.Namespace) -> int:
    import json
    import sys

    from toolkit.checkpoint.zero_to_hf import convert_zero_to_hf

    result = convert_zero_to_hf(args.ckpt_dir, args.out_dir, tag=args.tag, dtype=args.dtype,
                                max_shard_size=args.max_shard_size, config=args.config, progress=sys.stderr.isatty())
    summary = {"out_dir": str(result.out_dir), "tensors": result.tensors, "bytes": result.bytes_written,
               "shards": result.shards, "zero_stage": result.stage, "world_size": result.world_size}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"ZeRO-{result.stage} checkpoint of {result.world_size} ranks -> {result.out_dir}: "
              f"{result.tensors} tensors, {result.bytes_written / 2**20:.1f} MiB in {result.shards} shard(s)")
    return 0
