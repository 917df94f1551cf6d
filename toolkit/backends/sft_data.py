"""Supervised fine-tuning data: chat `messages` rendered with a chat template, or prompt/completion pairs, tokenised
with the loss on the assistant / completion tokens only (labels -100 elsewhere), then packed or padded.

The libraries do the work: transformers' `apply_chat_template(return_assistant_tokens_mask=True)` finds what the
assistant says through the template's `{% generation %}` markers (TRL's `get_training_chat_template` adds them to the
templates it knows); TRL's `common_prefix_length` splits prompt from completion as its SFTTrainer does; TRL's
`pack_dataset` (best-fit decreasing, examples kept whole) packs, and its `DataCollatorForLanguageModeling` with
`padding_free` flattens a micro-batch with position ids that restart at every example, which transformers' mask
builder turns into a block-diagonal causal mask (sdpa, eager) and the varlen kernels use directly (flash attention).
"""

from __future__ import annotations

import logging

from toolkit.errors import UserInputError
from toolkit.readers import read_text
from toolkit.spec.recipe import Recipe

log = logging.getLogger(__name__)
IGNORE_INDEX = -100  # labels the loss skips (torch's CrossEntropyLoss ignore_index)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
# ChatML, the default for tokenizers without a template (the byte-level BPE the tiny recipes train locally): what the
# assistant says, and the end of its turn, inside {% generation %} so that its tokens are the ones trained
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def check_columns(recipe: Recipe, columns: list[str]) -> None:
    data = recipe.data
    needed = {"chat": [("data.messages_field", data.messages_field)],
              "prompt_completion": [("data.prompt_field", data.prompt_field),
                                    ("data.completion_field", data.completion_field)]}[data.format]
    for key, column in needed:
        if column not in columns:
            raise UserInputError(key, f"'{column}' is not a column of data.train_files; columns: {', '.join(columns)}")


def tokenizer_texts(recipe: Recipe, rows):
    """The words of every example as one `text` column: what a locally trained BPE learns from."""
    data = recipe.data
    if data.format == "chat":
        return rows.map(lambda row: {"text": "\n".join(m["content"] for m in row[data.messages_field])},
                        remove_columns=rows.column_names)
    return rows.map(lambda row: {"text": row[data.prompt_field] + row[data.completion_field]},
                    remove_columns=rows.column_names)


def chat_template(recipe: Recipe, tokenizer) -> str:
    """The recipe's template file, or the tokenizer's own (in TRL's training variant with generation markers, where
    TRL knows it), or ChatML."""
    if recipe.data.chat_template:
        path = recipe.path(recipe.data.chat_template)
        if not path.is_file():
            raise UserInputError("data.chat_template", f"{path} does not exist (a Jinja chat template file)")
        return read_text(path, "data.chat_template", what="a Jinja chat template file")
    if not tokenizer.chat_template:
        return CHATML_TEMPLATE
    from trl.chat_template_utils import get_training_chat_template

    return get_training_chat_template(tokenizer) or tokenizer.chat_template


def _chat_example(tokenizer, template: str, messages_field: str):
    def tokenize(row):
        rendered = tokenizer.apply_chat_template(row[messages_field], chat_template=template, tokenize=True,
                                                 return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(rendered["input_ids"]), list(rendered["assistant_masks"])
        return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)],
                "trained": sum(mask)}

    return tokenize


def _prompt_completion_example(tokenizer, prompt_field: str, completion_field: str):
    from trl.data_utils import common_prefix_length

    eos = tokenizer.eos_token_id

    def tokenize(row):
        prompt = tokenizer(row[prompt_field], add_special_tokens=False)["input_ids"]
        ids = tokenizer(row[prompt_field] + row[completion_field], add_special_tokens=False)["input_ids"] + [eos]
        start = common_prefix_length(prompt, ids)  # where the completion begins, as TRL's SFTTrainer finds it
        return {"input_ids": ids, "labels": [IGNORE_INDEX] * start + ids[start:], "trained": len(ids) - start}

    return tokenize


def tokenized_examples(recipe: Recipe, tokenizer, rows):
    """`input_ids` and `labels` (-100 but on the assistant / completion tokens) of every example."""
    data = recipe.data
    check_columns(recipe, rows.column_names)
    if data.format == "chat":
        example = _chat_example(tokenizer, chat_template(recipe, tokenizer), data.messages_field)
    else:
        example = _prompt_completion_example(tokenizer, data.prompt_field, data.completion_field)
    tokens = rows.map(example, remove_columns=rows.column_names)
    if data.format == "chat" and min(tokens["trained"], default=0) == 0:
        raise UserInputError("data.chat_template", "an example has no assistant tokens to train on: the chat template "
                                                   "needs {% generation %} ... {% endgeneration %} around what the "
                                                   "assistant says (or the example has no assistant message)")
    return tokens.remove_columns("trained")


def sft_datasets(recipe: Recipe, tokenizer, rows, seq_len: int):
    """(train, eval, collator): examples held out before packing, then packed into rows of at most seq_len tokens
    (packing) or truncated to seq_len (one example per row)."""
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    tokens = tokenized_examples(recipe, tokenizer, rows)
    held_out = int(len(tokens) * recipe.data.eval_fraction)
    splits = [tokens.select(range(len(tokens) - held_out)),
              tokens.select(range(len(tokens) - held_out, len(tokens))) if held_out else None]
    packing = recipe.data.packing
    for index, split in enumerate(splits):
        if split is None:
            continue
        if packing:
            splits[index] = pack_dataset(split, seq_len, strategy="bfd")
        else:
            splits[index] = split.map(lambda row: {k: row[k][:seq_len] for k in ("input_ids", "labels")})
    if len(splits[0]) < 2:
        raise UserInputError("data.train_files", f"only {len(splits[0])} training sequence(s); add data")
    log.info("%d training and %d eval sequences of at most %d tokens (%s)", len(splits[0]),
             len(splits[1]) if splits[1] is not None else 0, seq_len, "packed" if packing else "one example each")
    collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=packing)
    return splits[0], splits[1], collator


def keep_examples_apart(model) -> None:
    """Training needs no KV cache, and with one transformers' mask builder does not look for packed rows
    (masking_utils: find_packed_sequence_indices runs only when past_key_values is None)."""
    model.config.use_cache = False
