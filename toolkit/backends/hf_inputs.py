"""What the HF Trainer of a launch is built from: the launcher checked, its TrainingArguments, data and model."""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.backends import long_context
from toolkit.backends.data import build_tokenizer, load_texts, training_datasets
from toolkit.backends.loop import check_world
from toolkit.backends.peft_model import finetune_model
from toolkit.backends.sft_data import keep_examples_apart
from toolkit.compat.accelerate_seams import reset_process_state
from toolkit.data.blend import build_datasets, hf_batch, hf_flat_batch
from toolkit.data.tokenizer import hf_tokenizer
from toolkit.errors import UserInputError
from toolkit.generate.trainer_args import trainer_arguments
from toolkit.runtime import inprocess
from toolkit.runtime.metrics import configure_wandb
from toolkit.spec.backends import BACKENDS, backend_of
from toolkit.spec.options import VARIABLE_LENGTH_ATTENTION
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe, recipe_hf_config, recipe_vocab_size

if TYPE_CHECKING:
    from toolkit.backends.context import TrainContext
    from toolkit.backends.hf_hooks import TrainerHooks

log = logging.getLogger(__name__)


def installed_field_names(args_dict: dict) -> dict:
    """trainer_args.json uses transformers 5's current names; older 5.x releases (5.17 is on some GPU images) know
    activation checkpointing only by its former name, gradient_checkpointing."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    for name in ("activation_checkpointing", "activation_checkpointing_kwargs"):
        if name in args_dict and name not in fields:
            args_dict = dict(args_dict)
            args_dict[name.replace("activation", "gradient")] = args_dict.pop(name)
    return args_dict


def check_launch(plan: Plan) -> int:
    """The world size, once the launch is known to match the plan."""
    world = check_world(plan)
    # `accelerate launch` with an accelerate.yaml of the other backend would mix the two (the Trainer takes its
    # plugin from the launcher's environment)
    for backend in (b for b in BACKENDS.values() if b.hf_modules):
        variable = backend.train.TRAINER_HOOKS.accelerate_variable
        if os.environ.get(variable, "false").lower() == "true" and backend is not backend_of(plan):
            raise UserInputError("plan.backend", f"accelerate launch was given a {backend.name} accelerate.yaml but "
                                                 f"the plan trains with {plan.backend}; launch with the plan's own "
                                                 f"accelerate.yaml (dmt generate) or pass --backend {backend.name}")
    return world


def training_arguments(context: TrainContext, hooks: TrainerHooks, world: int, resharded: bool):
    """The TrainingArguments of the launch: the generated trainer_args.json with the command line's step overrides
    (without one, the generator's for the recipe's plan), completed and checked by the backend's hooks."""
    from transformers import TrainingArguments

    recipe, plan, output_dir, run = context.recipe, context.plan, context.output_dir, context.run
    if run.trainer_args is not None:  # a copy to the bottom: the Trainer fills in accelerator_config's dicts (num_steps),
        # and an in-process restart (training.restart: in_process) builds its arguments again from the same record
        args_dict = {**copy.deepcopy(run.trainer_args), **context.updates, "output_dir": str(output_dir)}
    else:
        args_dict = trainer_arguments(recipe, plan, str(output_dir), None)
    hooks.arguments(args_dict, recipe, plan, world, context.deepspeed_json, run.deepspeed, resharded)
    long_context.build_parallelism_config(args_dict)
    configure_wandb(recipe.training.report_to, output_dir)
    if inprocess.iteration() > 0:  # the Trainer again in this process (training.restart: in_process)
        reset_process_state()  # Accelerate's singletons as the last call left them: as a fresh process has none
    return TrainingArguments(**installed_field_names(args_dict))


def documents_apart(recipe: Recipe) -> bool:
    """Whether a blend's attention stays inside each document: transformers finds the documents of a packed row from
    its position ids (masking_utils.find_packed_sequence_indices: a block-causal mask for sdpa and eager, variable
    lengths for flash attention), so reset_attention_mask takes reset_position_ids here."""
    data = recipe.data
    if data.blend and data.reset_attention_mask and not data.reset_position_ids:
        log.warning("data.reset_attention_mask without data.reset_position_ids: the HF Trainer's models tell "
                    "documents apart by their position ids, so attention stays causal over the whole sequence")
    return bool(data.blend) and data.reset_attention_mask and data.reset_position_ids


@dataclass(frozen=True)
class TrainerData:
    tokenizer: Any  # the Trainer's processing_class
    train_set: Any
    eval_set: Any  # None without an eval split
    collator: Any
    documents_apart: bool  # a blend's packed rows attend inside each document (documents_apart)
    # flash attention's variable-length kernel sees documents only in a batch of one row: the micro-batch flattened
    flat: bool


def _tokenised(recipe: Recipe, plan: Plan, args, tokenizer_dir: Path):
    """(tokenizer, train, eval, collator) of train_files or a hub dataset: rank 0 builds and saves the tokenizer
    first, then every rank tokenises (the datasets cache fills once)."""
    with args.main_process_first(desc="tokenizer"):
        if tokenizer_dir.is_dir():  # the run's own, saved at its first launch
            tokenizer = hf_tokenizer(tokenizer_dir, "--output-dir")
        else:
            tokenizer = build_tokenizer(recipe, load_texts(recipe))
            if args.process_index == 0:
                tokenizer.save_pretrained(tokenizer_dir)
        train_set, eval_set, collator = training_datasets(recipe, tokenizer, plan.seq_len)
    return tokenizer, train_set, eval_set, collator


def training_data(recipe: Recipe, plan: Plan, args, output_dir: Path) -> TrainerData:
    """The tokenizer, datasets and collator: a blend's prepared tokens, else train_files or a hub dataset
    tokenised."""
    apart = documents_apart(recipe)
    flat = apart and plan.attention in VARIABLE_LENGTH_ATTENTION
    if recipe.data.blend:  # prepared tokens through Megatron-Core's datasets (a collective: rank 0 builds the cache)

        tokenizer = hf_tokenizer(recipe.path(recipe.data.tokenizer.path), "data.tokenizer.path")
        train_set, eval_set = build_datasets(recipe, plan.seq_len, plan.global_batch, output_dir,
                                             recipe_vocab_size(recipe))
        collator = hf_flat_batch if flat else hf_batch
    else:
        tokenizer, train_set, eval_set, collator = _tokenised(recipe, plan, args, output_dir / "tokenizer")
    if plan.sp > 1:
        collator = long_context.with_position_ids(collator)
    return TrainerData(tokenizer, train_set, eval_set, collator, apart, flat)


def build_model(recipe: Recipe, plan: Plan, output_dir: Path, args, data: TrainerData):
    """The model the Trainer trains: LoRA adapters on a frozen base, a pretrained model, or a new one from the
    recipe's config; packed rows kept apart and the plan's long-context parallelism in place."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if plan.finetune.peft:  # LoRA / QLoRA adapters on a frozen base (toolkit.backends.peft_model)

        model = finetune_model(recipe, plan, output_dir, args)
    elif recipe.model.pretrained:
        model = AutoModelForCausalLM.from_pretrained(recipe.locate(recipe.model.pretrained), dtype=torch.float32)
    else:
        config = AutoConfig.for_model(**recipe_hf_config(recipe))
        if config.vocab_size < len(data.tokenizer):
            raise UserInputError("model.config.vocab_size",
                                 f"{config.vocab_size} < tokenizer size {len(data.tokenizer)}")
        model = AutoModelForCausalLM.from_config(config, attn_implementation=plan.attention)

    if recipe.data.format != "text" or data.documents_apart:  # packed rows: each attends to itself only

        keep_examples_apart(model)
    long_context.prepare(model, plan, output_dir, args.process_index)
    return model
