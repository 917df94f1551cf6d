"""DeepSpeed's checkpoint format as `dmt ckpt` and `dmt convert zero-to-hf` see it: a ZeRO tag directory (or the
directory whose `latest` names one), bare or inside the HF Trainer's checkpoint-N. The reader is zero_checkpoint.py,
the conversion convert.py; a resume at another world size goes through universal.py."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

from toolkit.backends.deepspeed.convert import convert_zero_to_hf
from toolkit.backends.deepspeed.zero_checkpoint import MASTER_KEYS, OPTIM_SUFFIX, open_zero_checkpoint, rank_files
from toolkit.checkpoint.finite import finding, lazy_nonfinite, lazy_tensors, nonfinite
from toolkit.checkpoint.torch_zip import index_torch_file
from toolkit.errors import UserInputError
from toolkit.spec.backend import HFConversion

FORMATS = ("deepspeed-zero", "hf-trainer")  # a bare DeepSpeed layout; HF's Trainer checkpoint with a tag inside
MANIFEST_FORMAT = "hf-trainer+deepspeed"  # the manifest's `format`: HF Trainer's checkpoint-N with global_stepN inside
TO_HF = HFConversion(
    help="DeepSpeed ZeRO 1/2/3 checkpoint -> HF safetensors + config",
    description="Stream a DeepSpeed ZeRO checkpoint (HF Trainer or bare DeepSpeed layout, any world size) into HF "
                "safetensors; equal bit for bit to DeepSpeed's zero_to_fp32.",
    metavar="CKPT_DIR", source_help="directory with `latest` (or the tag directory)",
    line="ZeRO-{zero_stage} checkpoint of {world_size} ranks -> {out_dir}: {tensors} tensors, {mib:.1f} MiB in "
         "{shards} shard(s)",
    flags=(("--tag", {"default": None, "help": "checkpoint tag, e.g. global_step100 (default: from `latest`)"}),))
OPTIM_FILES = "*" + OPTIM_SUFFIX


def detect(path: Path) -> str | None:
    """"hf-trainer" for a Trainer checkpoint with a ZeRO tag directory inside, "deepspeed-zero" for DeepSpeed's own
    layout (rank files, or `latest` beside their tag directory), else None."""
    tagged = any(path.glob(f"*/{OPTIM_FILES}"))
    if (path / "trainer_state.json").is_file():
        return FORMATS[1] if tagged else None
    if any(path.glob(OPTIM_FILES)) or ((path / "latest").is_file() and tagged):
        return FORMATS[0]
    return None


def verify(path: Path, report, deep: bool) -> None:
    """Every rank file present, readable and of the size the model states imply; with `deep`, every floating tensor
    scanned for NaN/Inf."""
    try:
        checkpoint = open_zero_checkpoint(path)
    except UserInputError as exc:
        report.problem(exc.key, exc.message)
        return
    report.files_checked = max(report.files_checked, len(list(checkpoint.tag_dir.iterdir())))
    if deep:
        report.scan(_findings(checkpoint))


def inspect(path: Path) -> dict:
    checkpoint = open_zero_checkpoint(path)
    return dict(zero_stage=checkpoint.stage, world_size=checkpoint.world_size, optimizer_state=True,
                parameters=sum(math.prod(s) for s in checkpoint.param_shapes.values()), dtypes=["float32 (master)"],
                tag=checkpoint.tag_dir.name)


def to_hf(ckpt_dir: Path, out_dir: Path, dtype: str, max_shard_size: str, config: Path | None, progress: bool,
          tag: str | None = None) -> dict:
    result = convert_zero_to_hf(ckpt_dir, out_dir, tag=tag, dtype=dtype, max_shard_size=max_shard_size,
                                config=config, progress=progress)
    return {"out_dir": str(result.out_dir), "tensors": result.tensors, "bytes": result.bytes_written,
            "shards": result.shards, "zero_stage": result.stage, "world_size": result.world_size}


def _findings(checkpoint) -> Iterator:
    """Each trainable and frozen parameter's fp32 value by name, then every other floating tensor of every rank file
    (Adam's exp_avg and exp_avg_sq, 16-bit module weights, buffers) by its key."""
    for name, tensor in checkpoint.tensors():
        yield finding(checkpoint.tag_dir, f"tensor {name}", nonfinite(tensor))
    for file in rank_files(checkpoint.tag_dir):
        for key, lazy in lazy_tensors(index_torch_file(file, root=checkpoint.tag_dir), ""):
            if not lazy.is_floating_point or any(part in MASTER_KEYS for part in key.split(".")):
                continue  # the fp32 masters were scanned above, by parameter name
            yield finding(file, key, lazy_nonfinite(lazy))
