"""What every backend's run resumes from and is checked against: the run's identity (what a checkpoint must match
to be resumed), the checkpoint to resume from (latest verified, auto, or a path), and the guard's window it saved."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from toolkit.backends.data import data_files
from toolkit.checkpoint.manifest import latest_verified, read_manifest
from toolkit.checkpoint.safe_load import check_checkpoint
from toolkit.errors import UserInputError
from toolkit.runtime.incident import is_restart
from toolkit.runtime.metrics import keep_until
from toolkit.runtime.supervision import record_restart
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe

# the data section's keys that choose a blend's samples (a change makes another run)
BLEND_IDENTITY = {"blend", "split", "text_field", "reset_position_ids", "reset_attention_mask", "eod_mask_loss"}


def resume_checkpoint(output_dir: Path, resume: str | None, identity: dict, trim: bool = True) -> Path | None:
    """The checkpoint to resume from (latest: the latest verified one; auto: that if any, the way restarted and
    requeued jobs continue; or a path), checked to belong to this run. On rank 0, metrics.jsonl then drops the
    steps after it (they are trained again; `trim` False: the caller does, through trim_metrics, once it knows
    whether a newer local checkpoint resumes instead) and a restarted launch says in incident.json why it
    restarted."""
    latest = latest_verified(output_dir) if resume in ("auto", "latest") else None
    if resume == "auto":
        resume = "latest" if latest is not None else None
    path = None
    if resume:
        path = latest if resume == "latest" else Path(resume)
        if path is None or not path.is_dir():
            raise UserInputError("--resume", f"no checkpoint to resume from ({resume}) in {output_dir}")
        check_resume_compatible(path, identity)
        check_checkpoint(path, "--resume")  # DeepSpeed's, DCP's and ds_to_universal's loaders run any pickle
    record_restart(output_dir, path.name if path is not None else None)
    if trim:
        trim_metrics(output_dir, read_manifest(path)["step"] if path is not None else None)
    return path


def trim_metrics(output_dir: Path, step: int | None) -> None:
    """Rank 0 of a run resumed at `step` (None: from no checkpoint): metrics.jsonl drops the later steps."""
    if os.environ.get("RANK", "0") == "0" and (step is not None or is_restart()):
        # a restart without a checkpoint trains from step 1 again: the steps of the attempt that ended go too
        keep_until(output_dir, step or 0)


def guard_window(checkpoint: Path | None) -> list:
    """The spike rule's window as the checkpoint saved it (the guard judges a resumed run like the first one)."""
    return (read_manifest(checkpoint) or {}).get("guard_window", []) if checkpoint is not None else []


def run_identity(recipe: Recipe, plan: Plan) -> dict:
    """What must not change across a resume for it to continue the same run: batch, sequence, seed, data."""
    import hashlib

    digest = hashlib.sha256()
    for file in data_files(recipe) if not recipe.data.hub_dataset else []:
        digest.update(file.read_bytes())
    if recipe.data.blend:  # what the blend reads: its prefixes, weights, split, packing flags and files' sizes
        digest.update(json.dumps([recipe.data.model_dump(include=BLEND_IDENTITY),
                                  [_sizes(recipe.path(entry.prefix)) for entry in recipe.data.blend]]).encode())
    return {"global_batch": plan.global_batch, "seq_len": plan.seq_len, "seed": recipe.training.seed,
            "data": recipe.data.hub_dataset or digest.hexdigest()[:16]}


def _sizes(prefix: Path) -> list:
    """The sizes of a blend prefix's files (its sidecar and datasets): a prefix prepared again is another run."""
    names = [f"{prefix}{suffix}" for suffix in (".dmt.json", ".bin", ".idx")]
    names += [str(path) for path in prefix.parent.glob(f"{glob.escape(prefix.name)}_*_document.*")]
    return sorted((Path(name).name, Path(name).stat().st_size) for name in names if Path(name).is_file())


def check_resume_compatible(checkpoint: Path, identity: dict) -> None:
    """Refuse a resume that would silently become a different run (other batch, sequence length, seed or data)."""
    manifest = read_manifest(checkpoint)
    if manifest is None:
        raise UserInputError("--resume", f"{checkpoint} has no manifest: it was not completely saved by the toolkit")
    saved = manifest.get("run", {})
    changed = [f"{k}: {saved.get(k)} -> {v}" for k, v in identity.items() if saved.get(k) != v]
    if changed:
        raise UserInputError("--resume", f"{checkpoint.name} belongs to a different run ({'; '.join(changed)})")
