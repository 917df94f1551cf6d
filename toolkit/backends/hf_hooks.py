"""What a backend adds to the HF Trainer (toolkit/backends/hf_trainer.py): each HF Trainer backend's train.py
declares its `TRAINER_HOOKS`, a TrainerHooks whose defaults are "nothing to add"."""

from __future__ import annotations

import contextlib
from pathlib import Path

from toolkit.errors import UserInputError


class TrainerHooks:
    accelerate_variable = ""  # what `accelerate launch` sets when its accelerate.yaml is this backend's
    checkpoint_format = ""  # the manifest's `format` of its checkpoints (its checkpoint.py's MANIFEST_FORMAT)
    layout_keys: tuple[str, ...] = ()  # the plan options a checkpoint's manifest records of its layout

    def arguments(self, args_dict: dict, recipe, plan, world: int, deepspeed_json: str | None,
                  generated_deepspeed: dict | None, resharded: bool) -> None:
        """The trainer arguments completed and checked for this backend, before TrainingArguments is built."""

    def before_model(self, recipe, resume_path: Path | None, output_dir: Path, resharded: bool) -> Path | None:
        """What must happen before the model is built; the checkpoint to resume from (converted if need be)."""
        return resume_path

    def accelerator_building(self, plan):
        """The context the Trainer builds its Accelerator in."""
        return contextlib.nullcontext()

    def on_accelerator(self, accelerator, plan) -> None:
        """The Accelerator just built, before it prepares the model."""

    def callbacks(self, output_dir: Path, plan) -> list:
        """TrainerCallbacks of this backend, after the toolkit's own."""
        return []

    def on_save(self, model, checkpoint: Path, is_main: bool) -> None:
        """After the Trainer saved `checkpoint`, before its manifest is written (rank 0: is_main)."""

    def save_adapter(self, model, checkpoint: Path, is_main: bool) -> None:
        """A LoRA run's adapter, where the Trainer's own save does not write it whole."""


def refuse_fp16_without_gpu() -> None:
    """fp16 needs Accelerate's grad scaler on a GPU, whatever DeepSpeed's CPU accelerator says of the host (one with
    AVX-512 FP16 reports fp16 supported, and the HF Trainer then fails inside Accelerate)."""
    import torch

    if not torch.cuda.is_available():
        raise UserInputError("plan.precision", "fp16 mixed precision needs a GPU (Accelerate's grad scaler); use bf16 "
                                               "or fp32 on CPU ranks")
