"""Node-local checkpoints of a Megatron-Core run (recipe `checkpoint.local`) through NVIDIA Resiliency Extension's
LocalCheckpointManager, beside the persistent dist checkpoints (docs/faults.md).

The state is the persistent save's sharded state dict, handed to NVRx as Megatron-Core's own
MCoreTensorAwareStateDict (megatron/core/dist_checkpointing/tensor_aware_state_dict.py, the class Megatron-LM's
`--non-persistent-ckpt-type local` uses) with the `atomic` algorithm: each rank keeps every shard it holds, no
exchange between ranks (the `fully_parallel` one calls torch.cuda.synchronize after its exchange). The distributed
optimizer's state is `dp_reshardable` (each rank's own partition, no gather), so a local checkpoint resumes at the
layout that wrote it only. NVRx's synchronous save (its asynchronous one synchronizes CUDA) writes
DIR/<run name>/<rank>/iter_<step>_<rank>_local.pt on every rank through a `.dirty` file and a rename, meets at a
barrier, checks with an all_gather_object that every rank has it (`find_latest`) and removes the older ones: all of
that runs on gloo. Replication to peer ranks (CliqueReplicationStrategy) receives through CUDA buffers in 0.4.1, so
the recipe refuses it on CPU ranks (toolkit.planner.recipe.check_local_checkpoint).
"""

from __future__ import annotations

import logging
from pathlib import Path

from toolkit.backends.megatron.checkpoint import ASYNC_SHARDING, _gathered_params, _sharded_state, apply_state, layout
from toolkit.checkpoint.safe_load import check_checkpoint
from toolkit.compat.megatron_seams import torch_adam_distributed_load

log = logging.getLogger(__name__)
ALGO = "atomic"  # MCoreTensorAwareStateDict's: every rank its own shards, no exchange (no CUDA)
SHARDING = ASYNC_SHARDING  # the distributed optimizer's own partition on each rank (Megatron-LM's for local saves)
FILE_PATTERN = "iter_*_*_local.pt"  # LocalCheckpointManager._filename_from_template's names


def local_root(local, output_dir: Path) -> Path:
    """checkpoint.local.dir; relative to the run's output directory."""
    root = Path(local.dir).expanduser()
    return root if root.is_absolute() else Path(output_dir) / root


class LocalCheckpoints:
    """One per rank, once the process group exists. `local` is the recipe's checkpoint.local."""

    def __init__(self, local, output_dir: Path, session: str, plan, identity: dict):
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (  # lazy: nvidia_resiliency_ext
            LocalCheckpointManager,
        )

        strategy = None
        if local.replication > 1:  # GPUs only (the recipe's rule): NVRx's clique over ranks one node apart
            from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (  # lazy: nvidia_resiliency_ext
                CliqueReplicationStrategy,
            )

            strategy = CliqueReplicationStrategy.from_replication_params(replication_jump=plan.gpus_per_node,
                                                                         replication_factor=local.replication)
        self.every, self.root = local.every, local_root(local, output_dir)
        self.manager = LocalCheckpointManager(self.root, session_id=session, repl_strategy=strategy)
        # what a local checkpoint must match to be resumed: the run (a rerun of the recipe into another output
        # directory must not continue the last one's node-local state) and the layout
        self.stamp = {"run": identity, "layout": layout(plan), "output_dir": str(Path(output_dir).resolve())}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, setup, step: int) -> None:
        """Every rank: this step's state into the node-local directory (NVRx: written, checked on every rank, the
        older ones removed)."""
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

        _gathered_params(setup)
        state = _sharded_state(setup, step, is_loading=False, with_rng=True, sharding=SHARDING)
        state["local_checkpoint"] = self.stamp
        aware, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo=ALGO)
        self.manager.save(aware, step, is_async=False)
        log.info("local checkpoint of step %d in %s", step, self.manager.local_ckpt_dir)

    def latest(self) -> int:
        """Every rank: the newest step every rank has a local checkpoint of (NVRx's find_latest; with replication a
        rank's lost copy counts when a peer holds its replica), -1 if none."""
        return self.manager.find_latest()

    def clear(self) -> None:
        """This rank's local checkpoints removed: a run that does not resume from them (a fresh start, an explicit
        --resume, another run's) saves from an older step, which NVRx's manager refuses while a newer one is there."""
        for path in self.manager.local_ckpt_dir.glob(FILE_PATTERN):
            path.unlink()
        self.manager.latest_iteration = -1  # NVRx's cache of find_latest (its save asserts it is older)

    def load(self, setup) -> int | None:
        """Every rank: the latest local checkpoint (after `latest`) into model, optimizer, scheduler and RNG; its
        step, or None (nothing loaded) when it was written by another run or at another layout."""
        check_checkpoint(self.manager.local_ckpt_dir, "checkpoint.local.dir")  # NVRx torch.loads them unrestricted
        loaded, ckpt_id = self.manager.load()
        if loaded.common.get("local_checkpoint") != self.stamp:
            log.warning("local checkpoint %s was written by another run or layout: resuming from the persistent one",
                        ckpt_id)
            return None
        with torch_adam_distributed_load(setup.optimizer):
            state = loaded.to_state_dict(_sharded_state(setup, 0, is_loading=True, with_rng=True, sharding=SHARDING),
                                         algo=ALGO)
            apply_state(setup, state, with_rng=True)
        return int(state["iteration"])
