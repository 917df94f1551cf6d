"""What every training loop does around its steps, whatever the engine (HF Trainer with DeepSpeed or FSDP2,
Megatron-Core's own loop): the world-size check, the data fingerprint of a step (`data_sha`), a scheduler's
save-and-exit request, the guard's verdict and its action (the report, the rollback target, the reload's bookkeeping),
the metrics.jsonl record of a step and of a checkpoint. The engines differ only in how they drop or reload a step and
how they write a checkpoint."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from toolkit.checkpoint.manifest import latest_verified, read_manifest
from toolkit.checkpoint.safe_load import check_checkpoint
from toolkit.errors import UserInputError
from toolkit.runtime.guard import LossGuard, Verdict, record_verdict, step_record
from toolkit.runtime.metrics import CHECKPOINT_KIND
from toolkit.runtime.supervision import SAVE_AND_EXIT
from toolkit.spec.plan import Plan

log = logging.getLogger(__name__)
DATA_SHA_LENGTH = 16  # hex digits of a step's data fingerprint


def check_world(plan: Plan) -> int:
    """The launched world size, refused in one line when it is not the plan's."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.gpus:
        raise UserInputError("cluster.gpus", f"the plan is for {plan.gpus} processes but {world} were launched")
    return world


def reduced_flag(value: bool, op: str) -> bool:
    """`value` reduced over every rank (MAX: any rank, MIN: every rank) on the device the process group uses."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if value else 0.0])
    if dist.is_initialized():
        flag = flag.cuda() if dist.get_backend() == "nccl" else flag
        dist.all_reduce(flag, op=getattr(dist.ReduceOp, op))
    return flag.item() > 0


def save_and_exit_requested(output_dir: Path) -> bool:
    """A scheduler asked for a save and an exit (the file SAVE_AND_EXIT) on any rank's view of the output directory;
    every rank gets the same answer at the same step."""
    return reduced_flag((Path(output_dir) / SAVE_AND_EXIT).exists(), "MAX")


def _sample_digests(input_ids) -> list[bytes]:
    """One digest per sample (row) of a batch of token ids, as int64 whatever the loader's dtype."""
    import hashlib

    import torch

    rows = input_ids.detach().cpu().reshape(input_ids.shape[0], -1).to(torch.int64).numpy()
    return [hashlib.sha256(row.tobytes()).digest() for row in rows]


def fingerprint(digests: list[bytes]) -> str:
    """A global batch's data fingerprint from its samples' digests: in a canonical order, so it names the samples
    whatever the layout (a resume on fewer ranks, another micro-batch, sees the same samples dealt out differently)."""
    import hashlib

    return hashlib.sha256(b"".join(sorted(digests))).hexdigest()[:DATA_SHA_LENGTH]


def global_batch_fingerprint(input_ids) -> str:
    """The fingerprint of a whole global batch held by this rank (Megatron-Core's loop reads every step's)."""
    return fingerprint(_sample_digests(input_ids))


class BatchFingerprints:
    """The samples of the micro-batches this rank trained on since the last digest (fed from the training step, not
    the collator, which the data loader runs ahead of training); the digest gathers every data-parallel rank's, so
    it names the global batch as global_batch_fingerprint does."""

    def __init__(self):
        self.recent: list[bytes] = []

    def add(self, input_ids) -> None:
        self.recent += _sample_digests(input_ids)

    def digest(self, clear: bool = True, group=None) -> str:
        """Called on every rank (of `group`, the world by default) at the same step (a collective)."""
        import torch.distributed as dist

        digests = self.recent
        if clear:
            self.recent = []
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, digests, group=group)
            digests = [digest for part in gathered for digest in part]
        return fingerprint(digests)


class StepGuard:
    """The guard inside a training loop (one per rank): the verdict on a step, its report, the checkpoint a rollback
    goes back to (the latest verified one; none turns the rollback into a stop), and what metrics.jsonl says of the
    steps it judged. The loop drops or reloads the step its engine's way."""

    def __init__(self, guard: LossGuard, output_dir: Path, rank: int):
        self.guard, self.output_dir, self.rank = guard, Path(output_dir), rank
        self.verdict: Verdict | None = None  # of the step in flight
        self.target: Path | None = None  # the checkpoint its rollback reloads
        self.records: dict[int, dict] = {}  # step -> what metrics.jsonl says of a guarded step

    def begin_step(self) -> None:
        self.verdict, self.target = None, None

    def judge(self, step: int, loss: float, grad_norm: float | None = None) -> Verdict:
        return self.guard.judge(step, loss, grad_norm)

    def act(self, step: int, verdict: Verdict, data_sha: str | None) -> Verdict:
        """Report a verdict (rank 0 writes incident.json; `stop` raises GuardStop on every rank) and remember it
        for the step; a rollback without a verified checkpoint to go back to is a stop."""
        extra = {}
        if verdict.action == "rollback":
            self.target = latest_verified(self.output_dir)
            if self.target is None:
                verdict = Verdict("stop", verdict.reason + "; no verified checkpoint to roll back to", verdict.loss)
            else:  # the libraries reload it with their unrestricted unpicklers: its pickles pass here first

                check_checkpoint(self.target, "rollback checkpoint")
                extra = {"checkpoint": self.target.name,
                         "dropped_steps": [read_manifest(self.target)["step"] + 1, step]}
        self.verdict = verdict
        self.records[step] = {"loss": verdict.loss, "guard": step_record(step, verdict)}
        record_verdict(self.output_dir, self.rank, step, verdict, data_sha, **extra)
        return verdict

    def drops_step(self) -> bool:
        """The step in flight must not be applied (a rollback's step is: the reload replaces what it did)."""
        return self.verdict is not None and self.verdict.action == "skip"

    def rolling_back(self) -> Path | None:
        return self.target if self.verdict is not None and self.verdict.action == "rollback" else None

    def rolled_back(self, step: int) -> None:
        """After the loop reloaded `self.target` in place: its window, one more rollback to it counted (GuardStop
        past the cap)."""
        saved = read_manifest(self.target)
        self.guard.rolled_back_to(self.target, saved.get("guard_window", []))
        log.warning("guard: rolled back to %s at step %d; steps %d-%d dropped", self.target.name, step,
                    saved["step"] + 1, step)

    def end_step(self, step: int, loss: float) -> None:
        if self.verdict is None:
            self.guard.accept(step, loss)

    def window(self) -> list:
        return self.guard.state()

    def metrics_of(self, step: int) -> dict:
        """The guard's word on the steps logged now (the loss it measured, not a NaN filter's stand-in)."""
        guarded = {s: self.records.pop(s) for s in sorted(self.records) if s <= step}
        if not guarded:
            return {}
        extra = {"guard": [record["guard"] for record in guarded.values()]}
        if step in guarded:
            extra["loss"] = guarded[step]["loss"]
        return extra


def write_step_record(metrics, guard: StepGuard, step: int, loss, grad_norm, learning_rate, figures: dict,
                      data_sha: str, **extra) -> dict:
    """metrics.jsonl's record of a logged step (rank 0), with the guard's word on the steps it covers."""
    fields = {"loss": loss, **extra, **guard.metrics_of(step)}
    return metrics.write(step, fields.pop("loss"), grad_norm, learning_rate, figures, data_sha=data_sha, **fields)


def write_checkpoint_record(metrics, manifest: dict, checkpoint: Path, blocking_s: float, persist_s: float,
                            asynchronous: bool) -> dict:
    """metrics.jsonl's record of a checkpoint (rank 0, once its manifest is written): the time training was paused
    for it, the time until its files and manifest were complete, and its size (the files its manifest lists)."""
    size = sum(entry["bytes"] for entry in manifest["files"].values())
    log.info("%s: %d bytes, training paused %.3f s, complete after %.3f s (%s)", checkpoint.name, size, blocking_s,
             persist_s, "written in the background" if asynchronous else "synchronous")
    return metrics.append({"kind": CHECKPOINT_KIND, "step": manifest["step"], "checkpoint": checkpoint.name,
                           "async": asynchronous, "blocking_s": blocking_s, "persist_s": persist_s, "bytes": size})
