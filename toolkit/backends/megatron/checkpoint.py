"""Megatron-Core distributed checkpoints (dist_checkpointing) with the toolkit's manifest and `latest` pointer, and
the format as `dmt ckpt` and `dmt convert megatron-to-hf` see it (the conversions are convert.py).

Model and optimizer state are saved as ShardedTensors in the reshardable formats, so a checkpoint loads at another
TP/PP/DP layout. The distributed optimizer's state is saved `fully_reshardable` by a synchronous save (any layout) and
`dp_reshardable` by a background one (training.async_save): `fully_reshardable` gathers every optimizer buffer onto
data-parallel rank 0 while the state dict is built, inside the pause an asynchronous save exists to avoid (and it
holds the gathered copy there), while `dp_reshardable`, Megatron-LM's own default, saves each rank's partition with no
communication and no copy, and reshards in data parallelism only. The manifest records which (`optimizer_sharding`); a
load asks for that one, and a `dp_reshardable` checkpoint resumed at another model-parallel layout is refused in one
line. The iteration and the scheduler go into the common state; each rank's RNG states are a ShardedObject, restored
only when the layout is the same. On disk it is torch DCP (toolkit/checkpoint/dcp.py) beside Megatron's
metadata.json.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.backends.megatron.build import unwrapped
from toolkit.backends.megatron.convert import MOE_EXPERTS_KEY, megatron_to_hf
from toolkit.backends.megatron.dist_writer import MANIFEST_FORMAT  # the part's hook: the format's name
from toolkit.checkpoint.dcp_check import check_dcp, dcp_contents
from toolkit.checkpoint.manifest import data_position, point_latest, read_manifest, write_manifest
from toolkit.checkpoint.safe_load import read_dcp_metadata
from toolkit.compat.megatron_seams import torch_adam_distributed_load
from toolkit.errors import UserInputError
from toolkit.spec.backend import HFConversion

if TYPE_CHECKING:  # building a model is training's business: `dmt ckpt` and `dmt convert` read this module too
    from toolkit.backends.megatron.build import MegatronSetup

log = logging.getLogger(__name__)
FORMATS = ("megatron-dist",)
TO_HF = HFConversion(
    help="Megatron-Core dist checkpoint -> HF safetensors + config",
    description="Read a Megatron-Core dist checkpoint (converted or saved by training, any layout) back into HF "
                "safetensors.",
    metavar="MEGATRON_DIR", source_help=None, line="{source} -> {out_dir}: {tensors} tensors, {parameters:,} parameters")
# the distributed optimizer's checkpoint format (Megatron-Core's distrib_optim_sharding_type) per kind of save: a
# synchronous save any layout can load, a background one with nothing in its pause but this rank's own partition
SYNC_SHARDING, ASYNC_SHARDING = "fully_reshardable", "dp_reshardable"
# what a dp_reshardable checkpoint cannot change: its optimizer buffers are laid out per model-parallel rank
MODEL_PARALLEL_KEYS = ("tp", "pp", "vpp", "cp", "ep", "etp")
LAYOUT_KEYS = ("dp", "tp", "pp", "vpp", "cp", "ep", "distributed_optimizer", "micro_batch", "grad_accum",
               "global_batch")


def _model_state(setup: MegatronSetup) -> dict:
    chunks = unwrapped(setup)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _rng_state():
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _rng_object(state):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _sharded_state(setup: MegatronSetup, step: int, is_loading: bool, with_rng: bool, sharding: str) -> dict:
    state = _model_state(setup)
    state["optimizer"] = setup.optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                            metadata={"distrib_optim_sharding_type": sharding})
    state["iteration"] = step
    state["scheduler"] = setup.scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_object(_rng_state())
    return state


def _gathered_params(setup: MegatronSetup) -> None:
    """Every rank's model parameters complete before they are saved: with the distributed optimizer and
    overlap_param_gather, the all-gather of the update is left to the next forward's pre-hooks, so after the optimizer
    step each rank's copy of the parameters it does not own is one update behind (what the save would write, and a
    resume would train on). Megatron-LM forces the same synchronous gather before its saves
    (`disable_forward_pre_hook(model)`, param_sync=True, in training.py's save_checkpoint_and_time)."""
    if setup.config["ddp_config"].get("overlap_param_gather"):
        for chunk in setup.model:
            chunk.start_param_sync(force_sync=True)


def layout(plan) -> dict:
    """The manifest's layout of a plan, with the expert layers' TP (`etp`: parallel folding's, else the TP)."""
    return {**{k: getattr(plan, k) for k in LAYOUT_KEYS}, "etp": plan.expert_tp}


def saved_layout(manifest: dict) -> dict:
    """A manifest's layout; one written before the manifest named `etp` had the expert layers at the TP."""
    saved = manifest.get("layout", {})
    return {"etp": saved.get("tp"), **saved}


def save_checkpoint(setup: MegatronSetup, output_dir: Path, step: int, plan, identity: dict, saves,
                    hf_config: dict | None = None, watch=None, guard_window: list | None = None) -> Path:
    """Save on every rank into output_dir/checkpoint-<step> through `saves` (toolkit.backends.megatron.saves: in the
    background with training.async_save); once every rank's files are written, rank 0 writes the model's HF
    config.json (what `dmt convert megatron-to-hf` reads), the manifest (with the guard's window), and moves
    `latest`. `watch` (the training watchdog) hears the save's phases."""
    import json
    import shutil

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    ckpt = output_dir / f"checkpoint-{step}"
    sharding = ASYNC_SHARDING if saves.asynchronous else SYNC_SHARDING

    def write(asynchronous: bool):
        _gathered_params(setup)
        if dist.get_rank() == 0:
            shutil.rmtree(ckpt, ignore_errors=True)  # an incomplete save of the same step (no manifest) is replaced
            ckpt.mkdir(parents=True)
        dist.barrier()
        request = dist_checkpointing.save(_sharded_state(setup, step, is_loading=False, with_rng=True,
                                                         sharding=sharding), str(ckpt), async_sharded_save=asynchronous)
        if dist.get_rank() == 0 and hf_config is not None:  # (into an empty directory Megatron's save does not warn
            # about) before any hashing: a background save's starts once its shards are written
            (ckpt / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        return request

    def complete(files: dict | None = None) -> dict | None:
        """`files`: the hashes taken once every file was written (a background save's), else taken here."""
        if watch is not None:
            watch.phase(step, "manifest")
        dist.barrier()  # every rank's shards are on disk before they are hashed
        manifest = None
        if dist.get_rank() == 0:
            manifest = write_manifest(ckpt, step=step, world_size=dist.get_world_size(), layout=layout(plan),
                                      fmt=MANIFEST_FORMAT, files=files,
                                      extra={"run": identity, "guard_window": guard_window or [],
                                             "optimizer_sharding": sharding, **data_position(step, identity)})
            point_latest(output_dir, ckpt)
        dist.barrier()
        log.info("saved %s", ckpt)
        return manifest

    saves.save(step, ckpt, write, complete)
    return ckpt


def load_checkpoint(setup: MegatronSetup, ckpt: Path, plan) -> int:
    """Load model, optimizer, scheduler (and RNG when the layout is unchanged) from `ckpt`; returns its step."""
    from megatron.core import dist_checkpointing

    manifest = read_manifest(ckpt)
    if manifest is None:
        raise UserInputError("--resume", f"{ckpt} has no manifest: it was not completely saved by the toolkit")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise UserInputError("--resume", f"{ckpt} is a {manifest.get('format')} checkpoint, not {MANIFEST_FORMAT}")
    saved = saved_layout(manifest)
    if saved.get("distributed_optimizer") != plan.distributed_optimizer:
        raise UserInputError("--resume", f"{ckpt.name} was saved with distributed_optimizer="
                                         f"{saved.get('distributed_optimizer')}; resume with the same setting")
    sharding = optimizer_sharding(manifest, ckpt, plan)
    check_expert_resharding(manifest, ckpt, plan)
    same_layout = saved == layout(plan)
    with torch_adam_distributed_load(setup.optimizer):
        state = dist_checkpointing.load(_sharded_state(setup, 0, is_loading=True, with_rng=same_layout,
                                                       sharding=sharding), str(ckpt))
        apply_state(setup, state, same_layout)
    if not same_layout:
        log.info("layout changed (%s -> %s): model and optimizer resharded, RNG streams reseeded",
                 saved, layout(plan))
    return int(state["iteration"])


def apply_state(setup: MegatronSetup, state: dict, with_rng: bool) -> None:
    """A loaded state (a dist checkpoint's, or a local checkpoint's: toolkit.backends.megatron.local) into the model,
    optimizer, scheduler and, `with_rng`, the RNG streams; inside torch_adam_distributed_load."""
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    chunks = unwrapped(setup)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model"] if len(chunks) == 1 else state[f"model{i}"])
    with torch.no_grad():  # 0.16.1's dp_reshardable load copies into the fp32 main parameters (leaves that
        # require grad) without the no_grad its fully_reshardable load has
        setup.optimizer.load_state_dict(state["optimizer"])
    setup.scheduler.load_state_dict(state["scheduler"])
    if with_rng:
        rng = state["rng_state"]
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])


def optimizer_sharding(manifest: dict, ckpt: Path, plan) -> str:
    """The distributed optimizer's format `ckpt` was saved in (a checkpoint from before the manifest recorded it is
    fully_reshardable, the only one then); a dp_reshardable one loads at another data-parallel size only."""
    sharding = manifest.get("optimizer_sharding", SYNC_SHARDING)
    saved, current = saved_layout(manifest), layout(plan)
    changed = [f"{key} {saved.get(key)} -> {current.get(key)}" for key in MODEL_PARALLEL_KEYS
               if saved.get(key) != current.get(key)]
    if sharding == ASYNC_SHARDING and plan.distributed_optimizer and changed:
        raise UserInputError("--resume", f"{ckpt.name} was saved in the background (training.async_save), its "
                                         f"distributed optimizer state {ASYNC_SHARDING}, which reshards in data "
                                         f"parallelism only ({', '.join(changed)}): resume at its "
                                         f"{'/'.join(MODEL_PARALLEL_KEYS)} and save once with training.async_save: "
                                         f"false ({SYNC_SHARDING}) to change them")
    return sharding


def check_expert_resharding(manifest: dict, ckpt: Path, plan) -> None:
    """Megatron-Core 0.16.1 keeps the experts' optimizer state in an optimizer of its own only at EP > 1 (a
    ChainedOptimizer, its sharded keys prefixed chained_0/chained_1); at EP 1 the experts join the dense optimizer.
    A checkpoint's model reshards between any EP sizes, its optimizer state only between sizes above 1 (measured:
    EP 2 -> 1 fails in dist_checkpointing.load with the chained keys missing)."""
    saved = saved_layout(manifest).get("ep", 1)
    problem = expert_resharding_problem(saved, plan.ep)
    if problem:
        raise UserInputError("--resume", f"{ckpt.name} was saved at EP {saved}: {problem}")


def expert_resharding_problem(saved_ep: int, ep: int) -> str | None:
    """Why a checkpoint saved at `saved_ep` cannot resume at `ep` (check_expert_resharding), or None."""
    if (saved_ep > 1) == (ep > 1):
        return None
    return (f"Megatron-Core 0.16.1 keeps the experts' optimizer state apart only at EP > 1, so its optimizer state "
            f"moves between EP sizes above 1, not from EP {saved_ep} to EP {ep}")


def detect(path: Path) -> str | None:
    return FORMATS[0] if (path / "metadata.json").is_file() and any(path.glob("*.distcp")) else None


def verify(path: Path, report, deep: bool) -> None:
    check_dcp(path, report, deep)


def inspect(path: Path) -> dict:
    info = dcp_contents(path)
    experts = expert_contents(path)
    return {**info, "experts": experts} if experts else info


def expert_contents(path: Path) -> dict | None:
    """What a checkpoint's MoE experts are: how many per MoE layer, in how many layers, the bytes of one expert's
    weights in one layer, and the EP/ETP layout they were saved at (the manifest's; a checkpoint reshards on load,
    so that is where they came from, not a limit). None for a dense model."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(path)
    weights = {key: meta for key, meta in metadata.state_dict_metadata.items()
               if MOE_EXPERTS_KEY in key and "optimizer" not in key and isinstance(meta, TensorStorageMetadata)}
    if not weights:
        return None
    shapes = [tuple(meta.size) for meta in weights.values()]  # [layers, experts, ...] each (SequentialMLP's keys)
    per_expert = sum(math.prod(shape[2:]) * meta.properties.dtype.itemsize
                     for shape, meta in zip(shapes, weights.values()))
    saved = saved_layout(read_manifest(path) or {})
    return {"count": shapes[0][1], "moe_layers": shapes[0][0], "bytes_per_expert": per_expert,
            "tensors": sorted(weights), "ep": saved.get("ep"), "etp": saved.get("etp")}


def to_hf(ckpt_dir: Path, out_dir: Path, dtype: str, max_shard_size: str, config: Path | None,
          progress: bool) -> dict:
    return megatron_to_hf(ckpt_dir, out_dir, config=config, dtype=dtype, progress=progress,
                          max_shard_size=max_shard_size)
