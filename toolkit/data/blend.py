"""A recipe's `data.blend` as Megatron-Core datasets, for every backend: each prefix checked (its files, the tokenizer
it was prepared with, its largest token id against the model's vocabulary), then the train and valid datasets built
by Megatron-Core's own BlendedMegatronDatasetBuilder, GPTDatasetConfig and GPTDataset (the index cache built once by
rank 0 while the other ranks wait at its barrier), and the global sample order every backend reads them in.

Functions take the recipe (toolkit.spec.recipe.Recipe, the layer above this one, so not imported here).

The order: step s (from 1) trains the global samples (s-1)*global_batch .. s*global_batch-1 of the blend, whatever
the data-parallel size. A checkpoint records the samples consumed (a global count), so a resume starts reading at
that sample: no skipped batch is read, and the position does not depend on the layout that wrote it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from toolkit.compat.megatron_datasets_seams import index_cache_without_pickles
from toolkit.data import sidecar
from toolkit.data.indexed import (
    IndexedFiles,
    check_index_values,
    check_pair,
    check_plain_arrays,
    prefix_document_lengths,
)
from toolkit.data.split import megatron_split, split_shares
from toolkit.data.tokenizer import files_digest, megatron_tokenizer, tokenizer_directory
from toolkit.errors import UserInputError

log = logging.getLogger(__name__)
CACHE_DIR = "data_cache"  # under the run's output directory, unless data.cache_dir names one
# test-only: a directory where every process reading a blend appends the global sample indices it reads
# (<pid>.txt, one a line), so a test can see exactly what a resumed run read
READS_ENV = "DMT_DATA_READS"


@dataclass(frozen=True)
class BlendSource:
    key: str  # the recipe key it came from (data.blend.<i>.prefix)
    prefix: str  # the Megatron dataset prefix (PREFIX.bin / PREFIX.idx)
    weight: float
    record: dict | None  # its PREFIX.dmt.json, when it has one
    files: IndexedFiles | None = None  # its .idx's counts (check_pair)


def blend_sources(recipe) -> list[BlendSource]:
    """The blend's Megatron dataset prefixes, each one's files checked (present, index and data agreeing). A prefix is
    the --output-prefix of `dmt data prepare` (its sidecar names the dataset of data.text_field) or a Megatron
    dataset prefix itself."""
    field = recipe.data.text_field
    sources = []
    for number, entry in enumerate(recipe.data.blend):
        key, path = f"data.blend.{number}.prefix", recipe.path(entry.prefix)
        if sidecar.sidecar_path(path).is_file():
            record = sidecar.read_sidecar(path, key)
            if field not in record["datasets"]:
                raise UserInputError(key, f"{sidecar.sidecar_path(path)} holds the keys "
                                          f"{', '.join(sorted(record['datasets']))}, not data.text_field '{field}'")
            dataset = record["datasets"][field]["prefix"]
        elif Path(f"{path}.idx").exists() or Path(f"{path}.bin").exists():
            dataset = str(path)
            owner = str(path).removesuffix(f"_{field}_{sidecar.LEVEL}")  # the --output-prefix it was prepared as
            record = sidecar.read_sidecar(owner, key) if owner != str(path) and \
                sidecar.sidecar_path(owner).is_file() else None
        else:
            raise UserInputError(key, f"{path}: no {path.name}{sidecar.SUFFIX}, {path.name}.bin or {path.name}.idx "
                                      f"there; give the --output-prefix of `dmt data prepare` or a Megatron dataset "
                                      f"prefix")
        sources.append(BlendSource(key, dataset, entry.weight, record, check_pair(dataset, key)))
    return sources


def check_blend(recipe, vocab_size: int) -> list[BlendSource]:
    """blend_sources, each also prepared with the recipe's tokenizer (the sidecar's hash of its files) and holding no
    token id the model's vocabulary (`vocab_size`) lacks. Problems name the prefix's recipe key."""
    tokenizer = recipe.path(recipe.data.tokenizer.path)
    if not tokenizer.is_dir():
        raise UserInputError("data.tokenizer.path", f"{tokenizer} is not a directory; a blend needs the local "
                                                    f"tokenizer directory its prefixes were prepared with")
    _, digest = files_digest(tokenizer_directory(tokenizer, "data.tokenizer.path"))  # hashes regular files inside
    sources = blend_sources(recipe)
    for source in sources:
        named = (source.record or {}).get("tokenizer")
        if named is None:
            log.warning("%s (%s) has no %s: its tokenizer is not checked against data.tokenizer.path", source.key,
                        source.prefix, sidecar.SUFFIX)
        elif named.get("sha256") != digest:
            raise UserInputError(source.key, f"{source.prefix} was prepared with the tokenizer {named.get('path')} "
                                             f"(files sha256 {str(named.get('sha256'))[:12]}), not data.tokenizer.path "
                                             f"{tokenizer} (sha256 {digest[:12]}); prepare it again with this one")
        largest = _largest_token_id(source)
        if largest >= vocab_size:
            raise UserInputError(source.key, f"{source.prefix} holds token id {largest}, beyond the model's "
                                             f"vocabulary of {vocab_size} (model.config.vocab_size); ids must be "
                                             f"below it")
    return sources


def blend_document_lengths(recipe) -> list[tuple[float, object]]:
    """Each blend prefix's weight and its documents' lengths (tokens, the end-of-document token included), from its
    .idx: what GPTDataset's samples are cut from. A prefix whose sidecar says it was prepared without --append-eod
    holds no end-of-document token for reset_position_ids to restart at: refused, naming its key."""
    found = []
    for source in blend_sources(recipe):
        if source.record is not None and source.record.get("append_eod") is False:
            raise UserInputError(source.key, f"{source.prefix} was prepared without --append-eod: its documents end "
                                             f"in no end-of-document token, so position ids never restart inside a "
                                             f"sample")
        found.append((source.weight, prefix_document_lengths(source.prefix, source.key)))
    return found


def _largest_token_id(source: BlendSource) -> int:
    """The largest token id of a dataset: the sidecar's count where the sidecar describes these files (its document
    and token counts the .idx's own), else read from its .bin (memory-mapped): a sidecar edited, or left beside
    other files, never lets ids beyond the vocabulary through to an embedding's IndexError."""
    files = source.files
    for entry in ((source.record or {}).get("datasets") or {}).values():
        largest = entry.get("max_token_id")
        if entry.get("prefix") == source.prefix and type(largest) is int and largest >= -1 and files is not None \
                and entry.get("documents") == files.documents and entry.get("tokens") == files.tokens \
                and (largest >= 0) == (files.tokens > 0):
            return largest
    return _largest_in_bin(source.prefix)


def _largest_in_bin(prefix: str) -> int:
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = numpy.memmap(f"{prefix}.bin", dtype=IndexedDataset(prefix).index.dtype, mode="r")
    return int(data.max()) if data.size else -1


def _recorded_largest(source: BlendSource) -> int | None:
    entries = ((source.record or {}).get("datasets") or {}).values()
    return next((entry.get("max_token_id") for entry in entries if entry.get("prefix") == source.prefix), None)


@dataclass(frozen=True)
class TokenBound:
    """The vocabulary a blend's token ids must lie below, checked again on every batch where training reads it.
    check_blend believes a sidecar's max_token_id where its counts are the .idx's, which a sidecar edited by hand, or
    a .bin rewritten in place with the same lengths, still passes: its ids would reach the embedding (an IndexError on
    CPU, a device-side assert on a GPU). A max over the batch costs what the batch holds and reads nothing; only a
    batch past the vocabulary reads the prefixes' .bin files, on the way out, to name the one that holds it."""

    vocab_size: int
    sources: tuple[BlendSource, ...]

    def check(self, tokens, dataset_ids=None) -> None:
        """`tokens`: a batch of token ids (a tensor or array, one row per sample); `dataset_ids`: each row's index
        into the blend (BlendedDataset's dataset_id; None: not known)."""
        if tokens.numel() == 0 or int(tokens.max()) < self.vocab_size:
            return
        largest = int(tokens.max())
        if dataset_ids is not None:
            rows = tokens.reshape(len(dataset_ids), -1).max(dim=1).values
            culprits = [self.sources[int(dataset_ids[int((rows >= self.vocab_size).nonzero()[0])])]]
        elif len(self.sources) == 1:
            culprits = list(self.sources)
        else:
            culprits = [source for source in self.sources if _largest_in_bin(source.prefix) >= self.vocab_size]
        if not culprits:
            raise UserInputError("data.blend", f"a batch holds token id {largest}, beyond the model's vocabulary of "
                                               f"{self.vocab_size} (model.config.vocab_size)")
        source = culprits[0]
        recorded = _recorded_largest(source)
        said = f", though its {sidecar.SUFFIX} records max_token_id {recorded}: that record does not describe " \
               f"its .bin; prepare it again" if recorded is not None else ""
        raise UserInputError(source.key, f"{source.prefix} holds token id {largest}, beyond the model's vocabulary "
                                         f"of {self.vocab_size} (model.config.vocab_size){said}")


def cache_dir(recipe, output_dir: Path) -> Path:
    return recipe.path(recipe.data.cache_dir) if recipe.data.cache_dir else Path(output_dir) / CACHE_DIR


def dataset_config(recipe, sources: list[BlendSource], seq_len: int, cache: Path):
    """Megatron-Core's GPTDatasetConfig of the recipe's blend (the split, the packing flags, the seed)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    data = recipe.data
    return GPTDatasetConfig(
        random_seed=recipe.training.seed, sequence_length=seq_len,
        blend=([source.prefix for source in sources], [source.weight for source in sources]),
        split=megatron_split(data.split), path_to_cache=str(cache),
        tokenizer=megatron_tokenizer(recipe.path(data.tokenizer.path), "data.tokenizer.path"),
        reset_position_ids=data.reset_position_ids, reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss, create_attention_mask=data.reset_attention_mask)


def sample_counts(recipe, global_batch: int) -> list[int]:
    """Samples to build per split (train, valid, test): the whole run's, and one global batch per evaluation (of
    training.eval_steps; one evaluation when it is 0) where the split has a valid share."""
    training, shares = recipe.training, split_shares(recipe.data.split)
    evaluations = training.max_steps // training.eval_steps + 1 if training.eval_steps else 1
    return [training.max_steps * global_batch, evaluations * global_batch if shares[1] > 0 else 0, 0]


def build_datasets(recipe, seq_len: int, global_batch: int, output_dir: Path, vocab_size: int):
    """(train, valid or None) of the recipe's blend, built with Megatron-Core's BlendedMegatronDatasetBuilder on every
    rank (a collective where a process group exists: rank 0 builds the index cache, then the others read it)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    sources = check_blend(recipe, vocab_size)
    cache = cache_dir(recipe, output_dir)
    cache.mkdir(parents=True, exist_ok=True)
    # Megatron-Core reads its index cache with numpy.load(allow_pickle=True): only plain arrays may be there (checked
    # now, in one line naming the file), and its reads load none of the pickles a file swapped in later could hold
    check_plain_arrays(cache, "data.cache_dir")
    index_cache_without_pickles()
    config = dataset_config(recipe, sources, seq_len, cache)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sample_counts(recipe, global_batch), lambda: True,
                                                    config).build()
    for built in (train, valid):
        if built is not None:
            check_index_values(built, "data.cache_dir")
    if train is None or len(train) < recipe.training.max_steps * global_batch:
        raise UserInputError("data.split", f"the blend's train share ({recipe.data.split}) yields no training "
                                           f"samples; give train a positive share")
    log.info("blend of %d prefixes: %d training and %d valid samples of %d tokens (index cache %s)", len(sources),
             len(train), len(valid) if valid is not None else 0, seq_len, cache)
    bound = TokenBound(vocab_size, tuple(sources))
    return ReadSamples(train, bound), (ReadSamples(valid, bound) if valid is not None and len(valid) else None)


class ReadSamples:
    """A Megatron-Core dataset (BlendedDataset or GPTDataset) as a torch map-style dataset of its sample dicts,
    with the bound its batches' token ids are checked against where training reads them (`bound.check`); with
    READS_ENV set, each read is recorded (test-only)."""

    def __init__(self, dataset, bound: TokenBound):
        self.dataset, self.bound = dataset, bound
        self.reads = os.environ.get(READS_ENV)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        if self.reads:
            with open(Path(self.reads) / f"{os.getpid()}.txt", "a") as handle:
                handle.write(f"{int(index)}\n")
        return self.dataset[int(index)]


def step_samples(step: int, global_batch: int) -> range:
    """The global sample indices step `step` (from 1) trains on, at any data-parallel size."""
    return range((step - 1) * global_batch, step * global_batch)


def rank_samples(step: int, global_batch: int, dp_rank: int, dp_size: int) -> range:
    """This data-parallel rank's contiguous share of step_samples (Megatron-Core's loop)."""
    share = global_batch // dp_size
    first = (step - 1) * global_batch + dp_rank * share
    return range(first, first + share)


class RankSteps:
    """A data loader's batch sampler: this data-parallel rank's share of each step from `first` to `last` (Megatron-
    Core's loop, one batch a step)."""

    def __init__(self, global_batch: int, dp_rank: int, dp_size: int, first: int, last: int):
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.first, self.last = first, last

    def __iter__(self):
        return (list(rank_samples(step, self.global_batch, self.dp_rank, self.dp_size))
                for step in range(self.first, self.last + 1))

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)


class ConsumedSampler:
    """The HF Trainer's sampler over a blend: the global sample order from `consumed` on (the checkpoint's count),
    so a resume reads no skipped sample. Accelerate deals its micro-batches out to the ranks in turn, so each step's
    global batch is step_samples'."""

    def __init__(self, length: int, consumed: int = 0):
        self.length, self.consumed = length, consumed

    def __iter__(self):
        return iter(range(self.consumed, self.length))

    def __len__(self) -> int:
        return self.length - self.consumed


def stack_samples(samples: list[dict]) -> dict:
    """GPTDataset's sample dicts stacked into a batch (Megatron-Core's forward step reads it as it is)."""
    import torch

    return {key: torch.stack([torch.as_tensor(sample[key]) for sample in samples]) for key in samples[0]}


def hf_batch(samples: list[dict]) -> dict:
    """The HF Trainer's batch of GPTDataset samples: input_ids are the sample's tokens, position_ids its (with
    reset_position_ids, per document: transformers then keeps documents apart in attention), and the labels
    already shifted (shift_labels: the next token of every position, the sample's extra token included), with -100
    where GPTDataset's loss mask is 0 (eod_mask_loss)."""
    batch = stack_samples(samples)
    shifted = batch["labels"].clone()
    shifted[batch["loss_mask"] == 0] = -100
    return {"input_ids": batch["tokens"], "labels": batch["tokens"], "shift_labels": shifted,
            "position_ids": batch["position_ids"]}


def hf_flat_batch(samples: list[dict]) -> dict:
    """hf_batch as one row of micro_batch x seq_len tokens (transformers' padding-free layout, as its
    DataCollatorWithFlattening makes it): flash attention takes packed documents apart from the position ids only in a
    batch of one row (modeling_flash_attention_utils._is_packed_sequence), and every sample's position ids start at
    0, so the samples stay apart too."""
    return {key: value.reshape(1, -1) for key, value in hf_batch(samples).items()}
