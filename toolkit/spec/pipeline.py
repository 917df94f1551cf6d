"""How the decoder layers are cut over pipeline ranks and virtual stages: Megatron-Core 0.16's split, exactly.

`get_num_layers_to_build` and `get_transformer_layer_offset` (megatron/core/transformer/transformer_block.py,
transformer_layer.py) and the checks in TransformerConfig.__post_init__. Model chunks are laid out virtual stage by
virtual stage: for v in range(vpp), for r in range(pp), a chunk of n_r / vpp layers, where n_r is rank r's layer
count. An uneven split sets n_0 / n_{pp-1} (num_layers_in_first/last_pipeline_stage) and shares the rest evenly;
account_for_embedding/loss_in_pipeline_split count the embedding and the loss as one layer each, so the first chunk
of rank 0 and the last chunk of rank pp-1 build one layer fewer (the layout of Llama 3 405B, arXiv:2407.21783
Sec. 3.3.2). A rule of the plan (spec/plan.py refuses the splits Megatron-Core refuses) that the memory and
step-time models read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

# Megatron-Core's pipeline_model_parallel_layout (megatron/core/transformer/pipeline_parallel_layer_layout.py, 0.16.1):
# stages separated by "|", in the order virtual stage by virtual stage, then rank (stage j is rank j % pp, virtual
# stage j // pp); E the embedding, t a decoder layer, m a multi-token-prediction layer, L the loss; "x*n" and
# "(...)*n" repeat, commas are cosmetic. The toolkit writes the expanded form (no "*": one word of megatron_args.txt).
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
LAYOUT_CHARACTERS = "ELtm"


@lru_cache(maxsize=256)
def expand_layout(text: str) -> str:
    """The layout without repetitions or commas (`Et|(tt|)*2mL` -> `Et|tt|tt|mL`); ValueError naming the problem."""
    expanded = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):  # Megatron-Core's own two unrolling passes
        expanded = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), expanded)
    bad = next((c for c in expanded if c not in LAYOUT_CHARACTERS + "|"), None)
    if bad is not None:
        raise ValueError(f"{text[:80]!r}: {bad!r} is not a layer; stages hold E (embedding), t (decoder layer), "
                         f"m (MTP layer) and L (loss), separated by |, with x*n and (...)*n repeats")
    return expanded


def balanced_layout(num_layers: int, pp: int, vpp: int = 1, mtp_layers: int = 0) -> str | None:
    """A layout for layers that do not divide: the embedding, the loss and each MTP layer take one layer's place,
    and the pp x vpp stages get as equal shares as they can (the spare ones in the middle stages), as DeepSeek-V3's
    61 layers + 1 MTP layer run at PP 16 x VPP 2: `Et|(tt|)*30mL`. None when a stage would get nothing to hold."""
    stages = pp * vpp
    slots = num_layers + 2 + mtp_layers
    if stages < 2 or slots < 2 * stages:
        return None
    base, spare = divmod(slots, stages)
    sizes = [base] * stages
    middle = list(range(1, stages - 1))
    for index in sorted(middle, key=lambda i: abs(2 * i - (stages - 1)))[:spare]:
        sizes[index] += 1
    if spare > len(middle):  # more spares than middle stages: none left to balance
        return None
    decoders = [size - (index == 0) - (index == stages - 1) * (1 + mtp_layers) for index, size in enumerate(sizes)]
    if min(decoders) < 0 or sum(decoders) != num_layers:
        return None
    text = ["t" * n for n in decoders]
    text[0] = "E" + text[0]
    text[-1] += "m" * mtp_layers + "L"
    return "|".join(text)


_SPLITS: dict[tuple[int, int], tuple[object, PipelineSplit]] = {}  # PipelineSplit.of's, by the frozen plan's identity
SPLIT_ENTRIES = 8192


@dataclass(frozen=True)
class PipelineSplit:
    """How the decoder layers are cut over pipeline ranks and virtual stages (Megatron-Core's config fields)."""

    num_layers: int
    pp: int
    vpp: int = 1
    first_stage_layers: int | None = None  # num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # num_layers_in_last_pipeline_stage
    embedding_in_split: bool = False  # account_for_embedding_in_pipeline_split
    loss_in_split: bool = False  # account_for_loss_in_pipeline_split
    layout: str | None = None  # pipeline_model_parallel_layout, as given (expand_layout reads it)

    @classmethod
    def of(cls, num_layers: int, plan) -> PipelineSplit:
        key = (id(plan), num_layers)
        hit = _SPLITS.get(key)
        if hit is not None and hit[0] is plan:
            return hit[1]
        split = cls(num_layers, plan.pp, plan.vpp, plan.first_stage_layers, plan.last_stage_layers,
                    plan.account_for_embedding_in_pipeline_split, plan.account_for_loss_in_pipeline_split,
                    getattr(plan, "pipeline_model_parallel_layout", None))
        if getattr(type(plan), "model_config", {}).get("frozen"):  # a frozen Plan: its split is asked again and again
            if len(_SPLITS) >= SPLIT_ENTRIES:
                _SPLITS.clear()
            _SPLITS[key] = (plan, split)  # the entry keeps the plan alive: its id names no other meanwhile
        return split

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def layout_stages(self) -> list[str]:
        """The layout's stages in Megatron-Core's order (virtual stage by virtual stage, then rank)."""
        return expand_layout(self.layout).split("|")

    def layout_problem(self, mtp_layers: int | None) -> tuple[str, str] | None:
        """Megatron-Core's checks of a layout (PipelineParallelLayerLayout.__init__ and validate_layer_layout)."""
        try:
            stages = self.layout_stages()
        except ValueError as exc:
            return LAYOUT_FLAG, str(exc)
        if self.uneven or self.embedding_in_split or self.loss_in_split:
            return LAYOUT_FLAG, ("cannot be combined with --first/last-stage-layers or --account-for-embedding/loss-"
                                 "in-pipeline-split (Megatron-Core refuses both)")
        if len(stages) != self.pp * self.vpp:
            return LAYOUT_FLAG, (f"has {len(stages)} stages; it needs pp x vpp = {self.pp} x {self.vpp} = "
                                 f"{self.pp * self.vpp} (stages separated by |)")
        flat = "".join(stages)
        if flat[:1] != "E" or flat.count("E") != 1 or flat[-1:] != "L" or flat.count("L") != 1:
            return LAYOUT_FLAG, "must start with the embedding E and end with the loss L, each exactly once"
        if flat.count("t") != self.num_layers:
            return LAYOUT_FLAG, f"places {flat.count('t')} decoder layers (t); the model has {self.num_layers}"
        mtp = flat.count("m")
        if mtp_layers is not None and mtp not in (0, mtp_layers):
            return LAYOUT_FLAG, f"places {mtp} MTP layers (m); the model has {mtp_layers} (or place none: not trained)"
        holding = [j for j, stage in enumerate(stages) if "m" in stage]
        if holding and ("t" in flat[flat.index("m"):] or len(holding) > 1 or holding[0] // self.pp != self.vpp - 1):
            return LAYOUT_FLAG, ("MTP layers (m) come after every decoder layer, all in one stage of a rank's last "
                                 "virtual stage")
        return None

    @lru_cache(maxsize=4096)  # noqa: B019 (frozen and small: the plan search asks of the same splits)
    def problem(self, mtp_layers: int | None = None) -> tuple[str, str] | None:
        """(flag, message) for a split Megatron-Core refuses, else None."""
        if self.layout is not None:
            return self.layout_problem(mtp_layers)
        layers, pp, vpp, first, last = self.num_layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers
        custom = self.uneven or self.embedding_in_split or self.loss_in_split
        if custom and pp < 2:
            return "--first-stage-layers", "an uneven pipeline split needs --pp >= 2"
        if self.uneven and (self.embedding_in_split or self.loss_in_split):
            return ("--first-stage-layers", "cannot be combined with --account-for-embedding/loss-in-pipeline-split "
                                            "(Megatron-Core refuses both)")
        if self.uneven:
            for flag, value in (("--first-stage-layers", first), ("--last-stage-layers", last)):
                if value is not None and not 0 < value < layers:
                    return flag, f"must be between 1 and {layers - 1}, got {value}"
                if value is not None and value % vpp:
                    return flag, f"{value} layers do not divide into --vpp {vpp} virtual stages"
            ends = [v for v in (first, last) if v is not None]
            middle_stages, rest = pp - len(ends), layers - sum(ends)
            if bool(middle_stages) != bool(rest > 0) or rest < 0 or middle_stages and rest % middle_stages:
                return ("--first-stage-layers", f"{layers} layers minus first/last ({sum(ends)}) must split evenly "
                                                f"over the other {middle_stages} stages")
            if middle_stages and (rest // middle_stages) % vpp:
                return "--vpp", f"{vpp} must divide the {rest // middle_stages} layers of each middle pipeline stage"
            if vpp > 1 and not middle_stages:  # get_transformer_layer_offset divides by the middle stage count
                return "--vpp", "interleaving an uneven split needs a middle pipeline stage (Megatron-Core divides by zero)"
            return None
        slots = layers + self.embedding_in_split + self.loss_in_split
        if slots % (pp * vpp):  # get_num_layers_to_build: slots % pp, then (slots / pp) % vpp
            counted = " (+1 embedding, +1 loss)" if self.embedding_in_split and self.loss_in_split else (
                " (+1 embedding)" if self.embedding_in_split else " (+1 loss)" if self.loss_in_split else "")
            what = f"--pp x --vpp = {pp * vpp}" if vpp > 1 else f"{pp}"
            return ("--pp", f"{what} must divide the {layers} layers{counted}, or set "
                            f"--first-stage-layers/--last-stage-layers")
        return None

    def rank_layer_counts(self) -> list[int]:
        """n_r, the decoder layers of each pipeline rank over all its virtual stages."""
        if self.layout is not None:
            return [sum(sizes) for sizes in self.chunk_sizes()]
        if self.uneven:
            ends = (self.first_stage_layers or 0) + (self.last_stage_layers or 0)
            middle = self.pp - (self.first_stage_layers is not None) - (self.last_stage_layers is not None)
            counts = [(self.num_layers - ends) // middle if middle else 0] * self.pp
            if self.first_stage_layers is not None:
                counts[0] = self.first_stage_layers
            if self.last_stage_layers is not None:
                counts[-1] = self.last_stage_layers
            return counts
        per_rank = (self.num_layers + self.embedding_in_split + self.loss_in_split) // self.pp
        counts = [per_rank] * self.pp
        counts[0] -= self.embedding_in_split
        counts[-1] -= self.loss_in_split
        return counts

    def chunk_sizes(self) -> list[list[int]]:
        """Layers built by each (rank, virtual stage): Megatron-Core's get_num_layers_to_build."""
        if self.layout is not None:
            stages = self.layout_stages()
            return [[stages[v * self.pp + rank].count("t") for v in range(self.vpp)] for rank in range(self.pp)]
        if self.uneven:
            return [[n // self.vpp] * self.vpp for n in self.rank_layer_counts()]
        per_chunk = (self.num_layers + self.embedding_in_split + self.loss_in_split) // (self.pp * self.vpp)
        sizes = [[per_chunk] * self.vpp for _ in range(self.pp)]
        sizes[0][0] -= self.embedding_in_split
        sizes[-1][-1] -= self.loss_in_split
        return sizes

    def chunks(self) -> list[list[range]]:
        """Layer indices of each (rank, virtual stage); chunks follow virtual stage by virtual stage, then rank."""
        return _chunks(self)

    def stage_layers(self, stage: int) -> list[int]:
        return [layer for chunk in self.chunks()[stage] for layer in chunk]


@lru_cache(maxsize=1024)
def _chunks(split: PipelineSplit) -> list[list[range]]:
    sizes = split.chunk_sizes()
    chunks: list[list[range]] = [[] for _ in range(split.pp)]
    start = 0
    for v in range(split.vpp):
        for rank in range(split.pp):
            chunks[rank].append(range(start, start + sizes[rank][v]))
            start += sizes[rank][v]
    return chunks
