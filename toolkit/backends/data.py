"""Tokenizer and dataset for training: local files (or a hub dataset) read with `datasets`, tokenised, packed, split.

Without a tokenizer path the recipe trains a byte-level BPE on its own training files (deterministic for a given
corpus and vocabulary size), so tiny recipes need nothing from a hub.
"""

from __future__ import annotations

import logging
from pathlib import Path

from toolkit.backends.sft_data import CHATML_TOKENS, check_columns, sft_datasets, tokenizer_texts
from toolkit.data.tokenizer import hf_tokenizer
from toolkit.errors import UserInputError
from toolkit.spec.recipe import Recipe

log = logging.getLogger(__name__)
BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
EOS = "<|endoftext|>"


def data_files(recipe: Recipe) -> list[Path]:
    files = [recipe.path(f) for f in recipe.data.train_files]
    for file in files:
        if not file.is_file():
            raise UserInputError("data.train_files", f"{file} does not exist")
        if file.suffix not in BUILDERS:
            raise UserInputError("data.train_files", f"{file.name}: use .txt, .json, .jsonl or .parquet")
    return files


def load_rows(recipe: Recipe):
    """The recipe's examples as a `datasets.Dataset`, columns as in the files."""
    import datasets

    if recipe.data.hub_dataset:
        dataset = datasets.load_dataset(recipe.data.hub_dataset, split="train")
    else:
        files = data_files(recipe)
        builders = {BUILDERS[f.suffix] for f in files}
        if len(builders) > 1:
            raise UserInputError("data.train_files", "mix of file types; use one of text, json(l) or parquet")
        dataset = datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train")
    return dataset


def load_texts(recipe: Recipe):
    """A `datasets.Dataset` with one column `text` (for chat and prompt/completion data: the words of each example,
    which a locally trained tokenizer learns from)."""
    dataset = load_rows(recipe)
    if recipe.data.format != "text":
        check_columns(recipe, dataset.column_names)
        return tokenizer_texts(recipe, dataset)
    field = recipe.data.text_field
    if field not in dataset.column_names:
        raise UserInputError("data.text_field", f"'{field}' is not a column; columns: {', '.join(dataset.column_names)}")
    return dataset.rename_column(field, "text") if field != "text" else dataset


def build_tokenizer(recipe: Recipe, texts):
    """The recipe's tokenizer, or a byte-level BPE trained on the training texts."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if recipe.data.tokenizer.path:
        return hf_tokenizer(recipe.locate(recipe.data.tokenizer.path), "data.tokenizer.path")
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    special = [EOS] + (list(CHATML_TOKENS) if recipe.data.format == "chat" and not recipe.data.chat_template else [])
    bpe.train_from_iterator((t for t in texts["text"] if t), vocab_size=recipe.data.tokenizer.vocab_size,
                            min_frequency=2, special_tokens=special, show_progress=False)
    trained = Tokenizer.from_str(bpe.to_str())  # the trained tokenizer itself, through its public serialisation
    return PreTrainedTokenizerFast(tokenizer_object=trained, eos_token=EOS, pad_token=EOS, bos_token=EOS)


def training_datasets(recipe: Recipe, tokenizer, seq_len: int):
    """(train, eval, collator) of the recipe's data format: text packed into blocks (every token trained), or chat /
    prompt-completion examples with the loss on the answers only (toolkit.backends.sft_data)."""
    if recipe.data.format == "text":
        from transformers import default_data_collator

        return (*packed_datasets(recipe, tokenizer, seq_len), default_data_collator)

    return sft_datasets(recipe, tokenizer, load_rows(recipe), seq_len)


def packed_datasets(recipe: Recipe, tokenizer, seq_len: int):
    """(train, eval) datasets of `input_ids`/`labels` blocks of exactly seq_len tokens; eval is the last share."""
    texts = load_texts(recipe)
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        return {"ids": [ids + [eos] for ids in tokenizer(batch["text"])["input_ids"]]}

    def pack(batch):
        stream = [token for ids in batch["ids"] for token in ids]
        usable = len(stream) // seq_len * seq_len
        blocks = [stream[i : i + seq_len] for i in range(0, usable, seq_len)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokens = texts.map(tokenize, batched=True, remove_columns=texts.column_names)
    blocks = tokens.map(pack, batched=True, batch_size=1000, remove_columns=["ids"])
    if len(blocks) < 2:
        raise UserInputError("data.train_files", f"only {len(blocks)} block(s) of {seq_len} tokens; add data")
    held_out = int(len(blocks) * recipe.data.eval_fraction)
    train = blocks.select(range(len(blocks) - held_out))
    evaluation = blocks.select(range(len(blocks) - held_out, len(blocks))) if held_out else None
    log.info("%d training and %d eval blocks of %d tokens", len(train), held_out, seq_len)
    return train, evaluation
