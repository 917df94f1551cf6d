"""The recipe's `model:` and `data:` sections (what to train, on what), and the strict base of every section."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from toolkit.data.split import split_shares
from toolkit.numeric import FINITE, WEIGHT_MAX, WEIGHT_MIN
from toolkit.outputs import word_problem


class Section(BaseModel):
    """The base of every recipe section: unknown keys are refused, numbers are finite, and values strict, because
    `micro_batch: true` or `max_steps: "30"` is a mistake in a YAML file, not a 1 or a 30."""

    model_config = ConfigDict(extra="forbid", strict=True, **FINITE)


class ModelSection(Section):
    source: str | None = Field(None, description="Preset name, HF config.json or its directory, hub id, or toolkit spec.")
    config: dict | None = Field(None, description="An HF config.json inline (pre-training from random init).")
    pretrained: str | None = Field(None, description="Directory or hub id with weights to start from; omit to train "
                                                     "from random init.")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if (self.source is None) == (self.config is None):
            raise ValueError("set exactly one of model.source and model.config")
        return self


class TokenizerSection(Section):
    path: str | None = Field(None, description="Tokenizer directory or hub id; omit to train a byte-level BPE locally.")
    vocab_size: int = Field(512, gt=256, description="Vocabulary of the locally trained byte-level BPE.")


class BlendEntry(Section):
    prefix: str = Field(min_length=1, description="A prepared dataset: the --output-prefix of `dmt data prepare` "
                                                  "(its PREFIX.dmt.json names the dataset of data.text_field), or a "
                                                  "Megatron dataset prefix (PREFIX.bin/.idx), relative to the recipe.")
    weight: float = Field(ge=WEIGHT_MIN, le=WEIGHT_MAX, description="Its share of the samples, relative to the "
                                                                    "others' (normalised to sum to 1, as Megatron-LM's "
                                                                    "--data-path weights are).")
    model_config = ConfigDict(extra="forbid", strict=False, **FINITE)  # `weight: 1` is a weight as much as 1.0

    @field_validator("prefix")
    @classmethod
    def _one_word(cls, prefix: str) -> str:
        return _word(prefix)


def _word(text: str) -> str:
    """A path the generated files carry (megatron_args.txt): one word of them (toolkit.outputs.word_problem)."""
    problem = word_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


# data loader worker processes per rank unless data.num_workers says: a blend reads its samples from memory-mapped
# files in the workers; the other sources are tokenised and packed in memory ahead of training, so workers only copy
BLEND_WORKERS, IN_MEMORY_WORKERS = 2, 0


class DataSection(Section):
    train_files: list[str] = Field([], description="Local json/jsonl/text/parquet files (relative to the recipe).")
    hub_dataset: str | None = Field(None, description="A datasets hub id instead of local files (needs network).")
    blend: list[BlendEntry] = Field([], description="Prepared token datasets (`dmt data prepare`) mixed by weight, "
                                                    "read through Megatron-Core's BlendedMegatronDatasetBuilder and "
                                                    "GPTDataset by every backend; needs data.tokenizer.path (the "
                                                    "tokenizer they were prepared with).")
    split: str = Field("969,30,1", description="A blend's train,valid,test shares of each dataset's documents "
                                               "(Megatron-LM's --split).")
    cache_dir: str | None = Field(None, description="Where GPTDataset keeps a blend's index cache (relative to the "
                                                    "recipe); default: OUTPUT/data_cache. Built once, by rank 0.")
    num_workers: int | None = Field(None, ge=0, description=f"Data loader worker processes per rank; default "
                                                            f"{BLEND_WORKERS} with a blend, {IN_MEMORY_WORKERS} "
                                                            f"otherwise (those rows are packed in memory).")
    pin_memory: bool = Field(True, description="Pinned host memory for the batches (the data loader's pin_memory; "
                                               "nothing to pin on CPU ranks).")
    reset_position_ids: bool = Field(False, description="A blend's position ids restart at each end-of-document "
                                                        "token (GPTDataset's option).")
    reset_attention_mask: bool = Field(False, description="A blend's attention does not cross an end-of-document "
                                                          "token (GPTDataset's option; see docs/data.md, 'Blends', "
                                                          "for where this is exact).")
    eod_mask_loss: bool = Field(False, description="No loss on a blend's end-of-document tokens (GPTDataset's "
                                                   "option).")
    format: Literal["text", "chat", "prompt_completion"] = Field(
        "text", description="text: plain text, every token trained, packed into blocks; chat: `messages` lists "
                            "(role/content) rendered with the chat template, loss on the assistant tokens only; "
                            "prompt_completion: two fields, loss on the completion only.")
    text_field: str = Field("text", description="Column holding the text in json/jsonl/parquet files.")
    messages_field: str = Field("messages", description="chat: column holding the list of {role, content} messages.")
    prompt_field: str = Field("prompt", description="prompt_completion: column holding the prompt.")
    completion_field: str = Field("completion", description="prompt_completion: column holding the completion.")
    chat_template: str | None = Field(None, description="chat: a Jinja chat template file (relative to the recipe) "
                                                        "with {% generation %} markers around what the assistant "
                                                        "says; default: the tokenizer's own (TRL's training variant "
                                                        "where it has one), else ChatML.")
    packing: bool = Field(True, description="chat / prompt_completion: pack several examples per sequence (position "
                                            "ids restart per example, so neither attention nor the loss crosses an "
                                            "example boundary); false: one example per sequence, padded.")
    eval_fraction: float = Field(0.05, ge=0, lt=0.5, description="Share of packed sequences held out for eval.")
    tokenizer: TokenizerSection = Field(TokenizerSection(), description="Which tokenizer, or how to train one.")

    @field_validator("split")
    @classmethod
    def _split(cls, split: str) -> str:
        split_shares(split)
        return split

    @field_validator("cache_dir")
    @classmethod
    def _cache_word(cls, cache_dir: str | None) -> str | None:
        return cache_dir if cache_dir is None else _word(cache_dir)

    @model_validator(mode="after")
    def _one_source(self) -> "DataSection":
        if [bool(self.train_files), bool(self.hub_dataset), bool(self.blend)].count(True) != 1:
            raise ValueError("set exactly one of data.train_files, data.hub_dataset and data.blend")
        if self.blend and self.format != "text":
            raise ValueError("data.blend holds prepared text tokens: format must be text")
        if self.blend and not self.tokenizer.path:
            raise ValueError("data.blend needs data.tokenizer.path: the tokenizer its prefixes were prepared with")
        if self.chat_template is not None and self.format != "chat":
            raise ValueError("data.chat_template applies to format: chat")
        return self
