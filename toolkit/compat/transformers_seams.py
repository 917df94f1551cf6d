"""transformers' private API the toolkit reaches into: the Trainer's own resume functions (the guard's rollback),
the model classes' FSDP wrap list, the module-global DeepSpeed config that decides ZeRO-3 construction, and the test
its flash-attention path makes of a batch before it takes packed documents apart."""

from __future__ import annotations

import contextlib

from toolkit.compat import Seam

SEAMS = [
    Seam("transformers", "transformers.Trainer._load_from_checkpoint",
         "the guard's rollback reloads the model in the running Trainer exactly as its own resume does (FSDP's "
         "sharded state, the plain model); the Trainer's public resume is only train(resume_from_checkpoint=)"),
    Seam("transformers", "transformers.Trainer._load_optimizer_and_scheduler",
         "the rollback's optimizer and scheduler states, loaded as the Trainer's own resume loads them"),
    Seam("transformers", "transformers.Trainer._get_grad_norm",
         "overridden (toolkit/backends/hf_trainer.py) so the NaN/spike guard reads the global gradient norm clipping "
         "computes, once per step, before the optimizer steps; the Trainer has no public hook between the two. "
         "Overridden in place by ToolkitTrainer (an override, which the in-place check does not see); hf_guard.py "
         "refuses a step whose norm it did not see, so a rename stops training instead of switching the guard off"),
    Seam("transformers", "transformers.Trainer._save_optimizer_and_scheduler",
         "overridden (toolkit/backends/hf_trainer.py) with the same call inside toolkit.compat.dcp_async's context when "
         "checkpoints are written in the background (training.async_save): the one method of the Trainer's save that "
         "writes FSDP2's model and optimizer state (through Accelerate's DCP save); no public hook wraps it. A rename "
         "fails the run (TrainerSaves.writing refuses a save that wrote nothing in the background)"),
    Seam("transformers", "transformers.PreTrainedModel._no_split_modules",
         "the decoder layer classes FSDP2 wraps one by one: what Accelerate itself falls back to when the config "
         "names none; transformers has no public accessor"),
    Seam("transformers", "transformers.integrations.deepspeed._hf_deepspeed_config_weak_ref",
         "set aside while one process builds a random base whole (no zero.Init, whose collectives would wait for "
         "ranks that build nothing) and put back after: unset_hf_deepspeed_config() is public, but nothing public "
         "returns the config object to set back"),
    Seam("transformers", "transformers.modeling_flash_attention_utils._is_packed_sequence",
         "whether flash attention (plan.attention flash_attention_2) takes a batch's packed documents apart: only a "
         "one-row batch whose position ids restart, which is why a blend's micro-batch is flattened "
         "(toolkit/data/blend.py hf_flat_batch); tests/data/test_packed_attention.py asks it of the collator's "
         "batches, as _flash_attention_forward does; nothing public tells"),
]


def flash_takes_documents_apart(position_ids) -> bool:
    """Whether transformers' flash-attention forward runs the variable-length kernel over the documents the position
    ids of this batch mark (its own test, made of every batch without an attention mask)."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    return bool(_is_packed_sequence(position_ids, position_ids.shape[0]))


def no_split_modules(model_class) -> tuple[str, ...]:
    """The class names a model class says must not be split across devices (its decoder layers)."""
    return tuple(getattr(model_class, "_no_split_modules", None) or ())


def load_model_state(trainer, checkpoint: str) -> None:
    """The model's weights from a Trainer checkpoint, loaded by the Trainer's own resume code (not DeepSpeed's)."""
    trainer._load_from_checkpoint(checkpoint, trainer.model_wrapped if trainer.is_fsdp_enabled else None)


def load_optimizer_and_scheduler(trainer, checkpoint: str) -> None:
    trainer._load_optimizer_and_scheduler(checkpoint)


@contextlib.contextmanager
def without_deepspeed_config():
    """While active, transformers sees no DeepSpeed config (models are built whole, not inside zero.Init)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    kept = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = kept
