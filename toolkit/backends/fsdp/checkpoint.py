"""FSDP2's checkpoint format as `dmt ckpt` and `dmt convert fsdp-to-hf` see it: HF Trainer's checkpoint-N holding
Accelerate's SHARDED_STATE_DICT, one torch DCP directory each for the model (pytorch_model_fsdp_0/) and the
optimizer (optimizer_0/). The conversion is convert.py; DCP itself is read by toolkit/checkpoint/dcp.py."""

from __future__ import annotations

from pathlib import Path

from toolkit.backends.fsdp.convert import convert_fsdp_to_hf
from toolkit.checkpoint.dcp_check import check_dcp, dcp_contents
from toolkit.spec.backend import HFConversion

FORMAT = "hf-trainer+fsdp"  # HF Trainer's checkpoint-N with Accelerate's FSDP2 DCP dirs (pytorch_model_fsdp_0/)
FORMATS = (FORMAT,)
MANIFEST_FORMAT = FORMAT  # the manifest's `format` of the checkpoints FSDP2 training saves: the same name
TO_HF = HFConversion(
    help="FSDP2 sharded checkpoint (DCP) -> HF safetensors + config",
    description="Stream an Accelerate FSDP2 SHARDED_STATE_DICT checkpoint (a Trainer checkpoint-N or its "
                "pytorch_model_fsdp_0/, saved by any number of ranks) into HF safetensors, tensor by tensor; equal bit "
                "for bit to `accelerate merge-weights`.",
    metavar="CKPT", source_help="checkpoint-N, or its pytorch_model_fsdp_0/",
    line="FSDP2 checkpoint of {rank_files} rank file(s) -> {out_dir}: {tensors} tensors, {parameters:,} parameters, "
         "{mib:.1f} MiB in {shards} shard(s)")


def fsdp_dirs(path: Path) -> list[Path]:
    """The DCP directories Accelerate's FSDP saving writes into a Trainer checkpoint (pytorch_model_fsdp_0,
    optimizer_0)."""
    return sorted(p for p in path.glob("*_0") if p.is_dir() and (p / ".metadata").is_file()
                  and p.name.split("_")[0] in ("pytorch", "optimizer"))


def detect(path: Path) -> str | None:
    return FORMAT if (path / "trainer_state.json").is_file() and fsdp_dirs(path) else None


def verify(path: Path, report, deep: bool) -> None:
    for directory in fsdp_dirs(path):
        check_dcp(directory, report, deep)


def inspect(path: Path) -> dict:
    model = [d for d in fsdp_dirs(path) if d.name.startswith("pytorch_model_fsdp")]
    return {**(dcp_contents(model[0]) if model else {}), "sharding": "FSDP2 (torch DCP)",
            "optimizer_state": any(d.name.startswith("optimizer") for d in fsdp_dirs(path))}


def to_hf(ckpt_dir: Path, out_dir: Path, dtype: str, max_shard_size: str, config: Path | None,
          progress: bool) -> dict:
    return convert_fsdp_to_hf(ckpt_dir, out_dir, dtype=dtype, max_shard_size=max_shard_size, config=config,
                              progress=progress)
