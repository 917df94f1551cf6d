"""`dmt convert`: checkpoint conversion between DeepSpeed ZeRO, FSDP2 (DCP), HF safetensors and Megatron-Core
layouts, and LoRA adapters merged into their base."""

from __future__ import annotations

import argparse
from pathlib import Path

from toolkit.backends.megatron.convert import hf_to_megatron
from toolkit.backends.megatron.logit_check import run_check
from toolkit.checkpoint.atomic import check_output_dir
from toolkit.checkpoint.merge_lora import merge_lora
from toolkit.cli.paths import output_arg, path_arg
from toolkit.numeric import bounded_int, finite_float, json_text
from toolkit.spec.backends import BACKENDS

# the sizes huggingface_hub's shard splitter parses, as save_pretrained takes them (not KiB/MiB/GiB)
SHARD_SIZE_HELP = "largest safetensors shard: KB, MB, GB or TB, or a number of bytes (default %(default)s)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True, parser_class=type(parser))
    for backend in _converting():  # each backend's checkpoint -> HF, as its checkpoint part declares it
        _add_to_hf(sub, backend.conversion, backend.checkpoint.TO_HF)

    to_mcore = sub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron-Core dist checkpoint",
                              description="Write a Megatron-Core dist checkpoint (torch_dist) of an HF model that a "
                                          "GPTModel at this TP/PP/VPP/EP loads (and, resharded, other layouts).")
    to_mcore.add_argument("hf_dir", type=path_arg, metavar="HF_DIR")
    to_mcore.add_argument("out_dir", type=output_arg, metavar="OUT_DIR", help="new directory for the dist checkpoint")
    for flag, what in (("tp", "tensor"), ("pp", "pipeline"), ("vpp", "virtual pipeline"), ("ep", "expert")):
        to_mcore.add_argument(f"--{flag}", type=bounded_int, default=1, help=f"{what} parallel size it is meant for")
    to_mcore.add_argument("--etp", type=bounded_int, default=None,
                          help="expert tensor-parallel size it is meant for (parallel folding; default: --tp)")
    to_mcore.add_argument("--check", action="store_true", help="then compare logits with the HF model at --tp/--pp")
    to_mcore.add_argument("--json", action="store_true", help="print the result as one JSON object")

    merge = sub.add_parser("merge-lora", help="LoRA adapter + its base -> merged HF safetensors",
                           description="Merge a PEFT LoRA adapter (adapter_model.safetensors + adapter_config.json, a "
                                       "training checkpoint-N holds them) into its HF base, tensor by tensor; equal "
                                       "bit for bit to PEFT's merge_and_unload() of the base as stored.")
    merge.add_argument("base_dir", type=path_arg, metavar="BASE", help="the HF base model directory (safetensors)")
    merge.add_argument("adapter_dir", type=path_arg, metavar="ADAPTER", help="the adapter directory (or checkpoint-N)")
    merge.add_argument("out_dir", type=output_arg, metavar="OUT_DIR", help="new directory for the merged model")
    merge.add_argument("--max-shard-size", default="5GB", help=SHARD_SIZE_HELP)
    merge.add_argument("--json", action="store_true", help="print the result as one JSON object")

    check = sub.add_parser("check", help="max logit difference of an HF model and a Megatron-Core checkpoint",
                           description="Run the HF model and the Megatron-Core model of the checkpoint (at --tp/--pp, "
                                       "under torchrun when more than one process) on the same tokens.")
    check.add_argument("hf_dir", type=path_arg, metavar="HF_DIR")
    check.add_argument("megatron_dir", type=path_arg, metavar="MEGATRON_DIR")
    check.add_argument("--tp", type=bounded_int, default=1)
    check.add_argument("--pp", type=bounded_int, default=1)
    check.add_argument("--ep", type=bounded_int, default=1, help="expert-parallel size (folded over TP x DP)")
    check.add_argument("--etp", type=bounded_int, default=None, help="expert tensor-parallel size (default: --tp)")
    check.add_argument("--tolerance", type=finite_float, default=1e-4, help="largest max-abs logit difference that passes")
    check.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _converting():
    """The backends whose checkpoints `dmt convert` turns into HF models (a backend whose checkpoints are HF's own has
    no conversion)."""
    return [backend for backend in BACKENDS.values() if backend.checkpoint.to_hf is not None]


def _add_to_hf(sub, name: str, conversion) -> None:
    """`dmt convert <name>` as the backend's HFConversion declares it: CHECKPOINT OUT_DIR, its own flags, and the
    flags every conversion to HF has."""
    parser = sub.add_parser(name, help=conversion.help, description=conversion.description)
    parser.add_argument("ckpt_dir", type=path_arg, metavar=conversion.metavar, help=conversion.source_help)
    parser.add_argument("out_dir", type=output_arg, metavar="OUT_DIR", help="new directory for the HF model")
    extra = tuple(parser.add_argument(flag, **keywords).dest for flag, keywords in conversion.flags)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--max-shard-size", default="5GB", help=SHARD_SIZE_HELP)
    parser.add_argument("--config", type=path_arg, default=None,
                        help="HF config.json when the checkpoint has none beside it")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.set_defaults(to_hf=name, extra=extra)  # the flags only this conversion has, handed to its to_hf


def run(args: argparse.Namespace) -> int:
    handlers = {"hf-to-megatron": _hf_to_megatron, "merge-lora": _merge_lora, "check": _check}
    if getattr(args, "out_dir", None) is not None:  # before any input is read: never one of them, never a full one

        check_output_dir(args.out_dir)
    return _to_hf(args) if getattr(args, "to_hf", None) else handlers[args.direction](args)


def _to_hf(args: argparse.Namespace) -> int:
    """A backend's checkpoint -> HF safetensors + config, through its checkpoint part."""
    part = next(b for b in BACKENDS.values() if b.conversion == args.to_hf).checkpoint
    summary = part.to_hf(args.ckpt_dir, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size,
                         config=args.config, progress=_interactive(), **{dest: getattr(args, dest) for dest in args.extra})
    _print(args, summary, part.TO_HF.line.format(**summary, source=args.ckpt_dir, mib=summary.get("bytes", 0) / 2**20))
    return 0


def _interactive() -> bool:
    import sys

    return sys.stderr.isatty()


def _print(args: argparse.Namespace, summary: dict, line: str) -> None:

    print(json_text(summary) if args.json else line)


def _logit_check(args: argparse.Namespace, hf_dir: Path, ckpt: Path, tp: int, pp: int, tolerance: float = 1e-4) -> int:
    ep, etp = args.ep, args.etp
    result = run_check(hf_dir, ckpt, tp=tp, pp=pp, tolerance=tolerance, ep=ep, etp=etp)
    summary = {"max_abs_diff": result.max_abs_diff, "logit_scale": result.logit_scale, "tolerance": tolerance,
               "tp": tp, "pp": pp, "ep": result.ep, "etp": result.etp, "passed": result.passed}
    verdict = "passed" if result.passed else "FAILED"
    experts = f" ep={result.ep} etp={result.etp}" if result.ep > 1 else ""
    _print(args, summary, f"logits at tp={tp} pp={pp}{experts}: max abs difference {result.max_abs_diff:.3g} (logits up to "
                          f"{result.logit_scale:.3g}, tolerance {tolerance:g}): {verdict}")
    return 0 if result.passed else 1


def _hf_to_megatron(args: argparse.Namespace) -> int:
    result = hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
                            progress=_interactive(), etp=args.etp)
    summary = {"out_dir": str(result.out_dir), "tensors": result.tensors, "parameters": result.parameters,
               "layout": result.layout, "padded_vocab": result.padded_vocab}
    if not args.check:
        _print(args, summary, f"{args.hf_dir} -> {result.out_dir}: {result.tensors} tensors, {result.parameters:,} "
                              f"parameters, vocabulary padded to {result.padded_vocab} for tp={args.tp}")
        return 0
    if not args.json:
        print(f"{args.hf_dir} -> {result.out_dir}: {result.tensors} tensors, {result.parameters:,} parameters")
    return _logit_check(args, args.hf_dir, args.out_dir, args.tp, args.pp)


def _merge_lora(args: argparse.Namespace) -> int:
    summary = merge_lora(args.base_dir, args.adapter_dir, args.out_dir, max_shard_size=args.max_shard_size)
    _print(args, summary, f"{args.adapter_dir} merged into {args.base_dir} -> {summary['out_dir']}: "
                          f"{summary['merged']} of {summary['tensors']} tensors adapted (scaling "
                          f"{summary['scaling']:g}), {summary['shards']} shard(s)")
    return 0


def _check(args: argparse.Namespace) -> int:
    return _logit_check(args, args.hf_dir, args.megatron_dir, args.tp, args.pp, args.tolerance)
