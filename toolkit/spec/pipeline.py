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

from dataclasses import dataclass
from functools import lru_cache


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

    @classmethod
    def of(cls, num_layers: int, plan) -> PipelineSplit:
        return cls(num_layers, plan.pp, plan.vpp, plan.first_stage_layers, plan.last_stage_layers,
                   plan.account_for_embedding_in_pipeline_split, plan.account_for_loss_in_pipeline_split)

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def problem(self) -> tuple[str, str] | None:
        """(flag, message) for a split Megatron-Core refuses, else None."""
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
