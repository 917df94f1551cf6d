"""transformers' private API the toolkit reaches into: the Trainer's own resume functions (the guard's rollback),
the private Trainer methods ToolkitTrainer overrides, the model classes' FSDP wrap list, the module-global DeepSpeed
config that decides ZeRO-3 construction, the test its flash-attention path makes of a batch before it takes packed
documents apart, the causal LM forward and loss the tiled loss stands in for, and the names that differ between the
5.x releases the toolkit runs on (a GPU image's 5.17 and this one)."""

from __future__ import annotations

import contextlib

from toolkit.compat import Seam

_TRAINER = "toolkit/backends/hf_trainer.py: ToolkitTrainer overrides it (the class stays with the Trainer's setup)"
SEAMS = [
    Seam("transformers", "transformers.Trainer._load_from_checkpoint",
         "the guard's rollback reloads the model in the running Trainer exactly as its own resume does (FSDP's "
         "sharded state, the plain model); the Trainer's public resume is only train(resume_from_checkpoint=)",
         parameters=("self", "resume_from_checkpoint", "model")),
    Seam("transformers", "transformers.Trainer._load_optimizer_and_scheduler",
         "the rollback's optimizer and scheduler states, loaded as the Trainer's own resume loads them",
         parameters=("self", "checkpoint")),
    Seam("transformers", "transformers.Trainer._get_grad_norm",
         "overridden so the NaN/spike guard reads the global gradient norm clipping computes, once per step, before "
         "the optimizer steps; the Trainer has no public hook between the two. hf_guard.py refuses a step whose norm "
         "it did not see, so a rename stops training instead of switching the guard off",
         used_in=_TRAINER, parameters=("self", "model", "grad_norm")),
    Seam("transformers", "transformers.Trainer._save_optimizer_and_scheduler",
         "overridden with the same call inside toolkit.compat.dcp_async's context when checkpoints are written in the "
         "background (training.async_save): the one method of the Trainer's save that writes FSDP2's model and "
         "optimizer state (through Accelerate's DCP save); no public hook wraps it. A rename fails the run "
         "(TrainerSaves.writing refuses a save that wrote nothing in the background)",
         used_in=_TRAINER, parameters=("self", "output_dir")),
    Seam("transformers", "transformers.Trainer._get_train_sampler",
         "overridden so that a blend's samples come in its global order from the checkpoint's consumed count "
         "(toolkit.data.blend.ConsumedSampler): the Trainer takes no sampler from outside; the override passes its "
         "arguments through to this signature otherwise",
         used_in=_TRAINER, parameters=("self", "train_dataset")),
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
         "batches, as _flash_attention_forward does; nothing public tells",
         parameters=("position_ids", "batch_size")),
    Seam("transformers", "transformers.LlamaForCausalLM.forward",
         "the forward toolkit/backends/long_context.tile_loss replaces on the model (the causal LMs of the families "
         "share it): its replacement takes input_ids, labels and the loss keywords, drops logits_to_keep and hands "
         "the rest to the decoder; a new parameter must be looked at there",
         parameters=("self", "input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds",
                     "labels", "use_cache", "logits_to_keep", "kwargs")),
    Seam("transformers", "transformers.loss.loss_utils.ForCausalLMLoss",
         "what tile_loss computes tile by tile (labels shifted by one, -100 ignored, the sum over num_items_in_batch "
         "or the mean), replicated from transformers 5.23: a change of its code means the replica must be compared "
         "with it again", source_sha256="11473d541d68ac3f5087215ac5d5beaac6f2bc46802045de82f92adaeb0bf24d"),
    Seam("transformers", "transformers.loss.loss_utils.fixed_cross_entropy",
         "ForCausalLMLoss's reduction (sum over num_items_in_batch, else the mean), replicated by tile_loss from "
         "transformers 5.23", source_sha256="c0f9892b060995c969a832890efe18d91bb139b9b9fef6b3075d0a98e9013767"),
    Seam("transformers", "transformers.Trainer.loss_is_scaled_for_ga",
         "whether the Trainer's loss is already divided by the accumulation steps (loss_as_logged): newer than 5.17 "
         "(which has only the test below, loss_as_logged's fallback); None where the test decides"),
    *(Seam("transformers", f"transformers.Trainer.{name}", kind="in_source",
           why="the Trainer's own test of whether the model's loss is already scaled for gradient accumulation, "
               "which loss_as_logged repeats where loss_is_scaled_for_ga is missing (5.17)")
      for name in ("model_accepts_loss_kwargs", "compute_loss_func")),
    *(Seam("transformers", f"transformers.TrainingArguments.{name}",
           "the name trainer_args.json gives activation checkpointing (transformers 5's current one); "
           "toolkit/backends/hf_inputs.py installed_field_names renames it to gradient_checkpointing* only where the "
           "installed TrainingArguments lacks it (5.17)")
      for name in ("activation_checkpointing", "activation_checkpointing_kwargs")),
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


def loss_as_logged(trainer, loss, num_items_in_batch):
    """A micro-batch's share of the step's loss as HF Trainer's training_step returns it (and then sums for its
    log): divided by the accumulation steps unless the loss already is (HF's own test, transformers 5; the
    `loss_is_scaled_for_ga` override is newer than 5.17, which has the test alone)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) \
            or trainer.compute_loss_func is not None
    return loss if scaled else loss / trainer.current_gradient_accumulation_steps
