"""HF <-> Megatron-Core mappings as data and the engine that applies them: config fields, weight mapping types that
own their merge/split, and whole-model conversions of config dicts and state dicts.

A family module declares a `MegatronMapping`: which HF config key feeds which Megatron field (with HF's default for
an absent key and a transform each way), which Megatron choices the family fixes (normalization, activation, biases),
and which HF weight feeds which Megatron-Core weight (1:1 `Rename`s, or the typed merges `QKV`, `FusedQKV` and
`GatedMLP`). The generator (megatron.yaml) reads the config side; the checkpoint converter reads both sides.

Megatron-side names are `section.field`: `transformer_config.*` are `TransformerConfig` fields, `gpt_model.*` are
`GPTModel` arguments, and `model.vocab_size` is the tokenizer's vocabulary before Megatron pads it.
Weight names are those of Megatron-Core's local layer spec (`get_gpt_layer_local_spec`). The engine owns TP/PP
sharding; the mapping types only ever see whole (TP=1) tensors.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from toolkit.errors import UserInputError

REQUIRED = object()  # a Field default: the HF config must have the key
PADDED_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")  # rows Megatron pads past the vocabulary
MOE_MLP = (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts.")  # an MoE layer's; a dense one's: .mlp.linear_fc*


@dataclass(frozen=True)
class Field:
    """One HF config key and the Megatron field it feeds. `default` is HF's value when the key is absent (a callable
    gets the whole HF dict); `to_megatron` / `to_hf` transform the value each way (identity when None)."""

    hf: str
    megatron: str
    default: Any = REQUIRED
    to_megatron: Callable[[Any], Any] | None = None
    to_hf: Callable[[Any], Any] | None | bool = None  # False: not written back (another field owns the HF key)
    whole: bool = False  # to_megatron reads the whole HF config (a Megatron field several HF keys make)


@dataclass(frozen=True)
class Unsupported:
    """An HF setting Megatron-Core cannot express for this family: `when(value)` is true for the offending values."""

    hf: str
    when: Callable[[Any], bool]
    reason: str


@dataclass(frozen=True)
class WeightGeometry:
    """What the typed transforms need to know of a model: attention layout and the vocabulary before padding."""

    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool  # output_layer shares the embedding (no lm_head on the HF side)


class WeightMapping(ABC):
    """HF tensors <-> one Megatron-Core tensor. Names may hold {layer} and {expert}; a subclass that does not say
    how it reads, merges and splits cannot be built."""

    megatron: str
    optional: ClassVar[bool] = False  # a model may lack the tensor (it is skipped rather than refused)

    @abstractmethod
    def hf_names(self) -> tuple[str, ...]:
        """The HF tensors this mapping reads or writes."""

    @abstractmethod
    def to_megatron(self, read: Callable[[str], Any], geometry: WeightGeometry):
        """The whole (TP=1 name, unpadded) Megatron-Core tensor from the HF tensors `read(name)` returns. Works on
        meta tensors too, which is how the converter learns shapes without reading data."""

    @abstractmethod
    def to_hf(self, tensor, geometry: WeightGeometry) -> dict:
        """The HF tensors of one whole Megatron-Core tensor: fused tensors split back."""

    def expand(self, layer: int | None, expert: int | None) -> WeightMapping:
        """This mapping with {layer} and {expert} filled in."""
        return dataclasses.replace(self, **{name: value.format(layer=layer, expert=expert)
                                            for name, value in self.names().items()})

    def names(self) -> dict[str, str]:
        """Every tensor name this mapping holds, HF and Megatron, by field."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), str)}

    def absent_from(self, hf_tensors) -> bool:
        """True when the mapping is optional and the model lacks its HF tensors (then it is skipped)."""
        return self.optional and not all(name in hf_tensors for name in self.hf_names())


@dataclass(frozen=True)
class OneHFTensor(WeightMapping):
    """A mapping whose HF side is one tensor, which HF's Conv1D (GPT-2) stores as [in, out]: `transpose`."""

    hf: str
    megatron: str
    transpose: bool = False

    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def read_hf(self, read: Callable[[str], Any]):
        return read(self.hf).t() if self.transpose else read(self.hf)

    def written_hf(self, tensor) -> dict:
        return {self.hf: tensor.t().contiguous() if self.transpose else tensor}


@dataclass(frozen=True)
class Rename(OneHFTensor):
    """One HF weight is one Megatron weight."""

    optional: ClassVar[bool] = True

    def to_megatron(self, read, geometry):
        return self.read_hf(read)

    def to_hf(self, tensor, geometry):
        return self.written_hf(tensor[: geometry.vocab] if self.megatron in PADDED_VOCAB else tensor)


@dataclass(frozen=True)
class QKV(WeightMapping):
    """Separate q/k/v projections (weights or biases) <-> Megatron's linear_qkv, interleaved per query group."""

    q: str
    k: str
    v: str
    megatron: str

    def hf_names(self) -> tuple[str, ...]:
        return self.q, self.k, self.v

    def to_megatron(self, read, geometry):
        g = geometry
        return merge_qkv(read(self.q), read(self.k), read(self.v), g.heads, g.groups, g.head_dim)

    def to_hf(self, tensor, geometry):
        g = geometry
        return dict(zip(self.hf_names(), (t.contiguous() for t in split_qkv(tensor, g.heads, g.groups, g.head_dim))))


@dataclass(frozen=True)
class FusedQKV(OneHFTensor):
    """One HF tensor holding [q; k; v] (GPT-2's c_attn) <-> Megatron's linear_qkv."""

    def to_megatron(self, read, geometry):
        g = geometry
        q, k, v = self.read_hf(read).split([g.heads * g.head_dim, g.groups * g.head_dim, g.groups * g.head_dim], dim=0)
        return merge_qkv(q, k, v, g.heads, g.groups, g.head_dim)

    def to_hf(self, tensor, geometry):
        import torch

        g = geometry
        return self.written_hf(torch.cat(split_qkv(tensor, g.heads, g.groups, g.head_dim), dim=0))


@dataclass(frozen=True)
class GatedMLP(WeightMapping):
    """HF gate and up projections <-> Megatron's linear_fc1, which holds [gate; up] along the output dimension."""

    gate: str
    up: str
    megatron: str

    def hf_names(self) -> tuple[str, ...]:
        return self.gate, self.up

    def to_megatron(self, read, geometry):
        return merge_gated(read(self.gate), read(self.up))

    def to_hf(self, tensor, geometry):
        return dict(zip(self.hf_names(), (t.contiguous() for t in split_gated(tensor))))


@dataclass(frozen=True)
class StackedExpert(WeightMapping):
    """Expert {expert}'s slice of one HF tensor that stacks every expert of a layer on its first axis (GPT-OSS's
    experts.gate_up_proj [E, H, 2F], down_proj [E, F, H] and their biases) <-> that expert's Megatron-Core tensor.
    `interleaved`: the slice holds gate and up alternating on its last axis, which linear_fc1 holds as [gate; up];
    a two-axis slice is [in, out] (x @ W), Megatron's [out, in] transposed. `stacked`: the HF tensor is the experts'
    pieces stacked in expert order, which the writers gather."""

    hf: str
    megatron: str
    expert: str = "{expert}"
    interleaved: bool = False
    stacked: ClassVar[bool] = True

    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def to_megatron(self, read, geometry):
        import torch

        piece = read_row(read, self.hf, int(self.expert))
        piece = piece.t() if piece.dim() == 2 else piece  # [out, in] or a bias [out]
        return torch.cat([piece[0::2], piece[1::2]]).contiguous() if self.interleaved else piece.contiguous()

    def to_hf(self, tensor, geometry):
        import torch

        if self.interleaved:  # [gate; up] -> gate_0, up_0, gate_1, ...
            tensor = torch.stack(tensor.chunk(2), dim=1).reshape(tensor.shape)
        return {self.hf: (tensor.t() if tensor.dim() == 2 else tensor).contiguous()}


def read_row(read: Callable[[str], Any], name: str, index: int):
    """Row `index` of HF tensor `name`: through `read.row` where the reader has one (the converter's reads only that
    row's bytes of a stacked tensor), else the row of the whole tensor `read(name)`."""
    row = getattr(read, "row", None)
    return row(name, index) if row is not None else read(name)[index]


def stack_counts(items) -> dict[str, int]:
    """HF tensors that stack several mappings' pieces (StackedExpert), by how many pieces each stacks."""
    counts: dict[str, int] = {}
    for item in items:
        if getattr(item, "stacked", False):
            for name in item.hf_names():
                counts[name] = counts.get(name, 0) + 1
    return counts


class Stacker:
    """Gathers the pieces of stacked HF tensors (in table order, expert by expert) and hands each tensor on whole once
    its last piece arrives; other tensors pass straight through."""

    def __init__(self, items):
        self.counts, self.pending = stack_counts(items), {}

    def add(self, name: str, piece):
        """(name, tensor) once the tensor is whole, else None."""
        import torch

        if name not in self.counts:
            return name, piece
        pieces = self.pending.setdefault(name, [])
        pieces.append(piece)
        if len(pieces) < self.counts[name]:
            return None
        return name, torch.stack(self.pending.pop(name))


@dataclass(frozen=True)
class MegatronMapping:
    """A family's Megatron-Core GPTModel: its config fields, fixed choices, refused settings and weights."""

    architecture: str  # HF architectures[0], written back by the converter
    fields: tuple[Field, ...]
    fixed: dict = field(default_factory=dict)  # Megatron fields the family fixes, `section.field` -> value
    unsupported: tuple[Unsupported, ...] = ()
    weights: tuple[WeightMapping, ...] = ()  # names may hold {layer} and {expert}

    def __post_init__(self):
        foreign = [w for w in self.weights if not isinstance(w, WeightMapping)]
        if foreign:  # the engine only knows how to apply WeightMapping's methods
            raise TypeError(f"{type(foreign[0]).__name__} is not a WeightMapping: {foreign[0]!r}")

    def megatron_fields(self, hf_config: dict) -> dict[str, dict]:
        """Megatron sections (`{"transformer_config": {...}, "gpt_model": {...}, "model": {...}}`) of an HF config."""
        for rule in self.unsupported:
            if rule.hf in hf_config and rule.when(hf_config[rule.hf]):
                raise UserInputError(f"model.config.{rule.hf}", f"{hf_config[rule.hf]!r}: {rule.reason}")
        sections: dict[str, dict] = {}
        for item in self.fields:
            value = hf_config.get(item.hf, item.default)
            if value is REQUIRED:
                raise UserInputError(f"model.config.{item.hf}", f"is required for a {hf_config.get('model_type')} "
                                                                f"model")
            if callable(value) and item.hf not in hf_config:
                value = value(hf_config)
            if item.to_megatron is not None:
                value = item.to_megatron(hf_config if item.whole else value)
            section, name = item.megatron.split(".", 1)
            sections.setdefault(section, {})[name] = value
        for key, value in self.fixed.items():
            section, name = key.split(".", 1)
            sections.setdefault(section, {})[name] = value
        return sections

    def hf_fields(self, model_type: str, sections: dict[str, dict]) -> dict:
        """The reverse direction: HF config keys from Megatron sections (for a converter writing config.json)."""
        config = {"model_type": model_type, "architectures": [self.architecture]}
        for item in self.fields:
            section, name = item.megatron.split(".", 1)
            if item.to_hf is not False and name in sections.get(section, {}):
                value = sections[section][name]
                config[item.hf] = item.to_hf(value) if item.to_hf is not None else value
        return config

    def weight_table(self, hf_config: dict) -> tuple[list[WeightMapping], WeightGeometry]:
        """One mapping per concrete tensor of this model ({layer}/{expert} filled in, output_layer left out when the
        embeddings are tied) and the geometry the mappings' transforms need."""
        sections = self.megatron_fields(hf_config)
        tc = sections["transformer_config"]
        heads = tc["num_attention_heads"]
        geometry = WeightGeometry(heads, tc["num_query_groups"], tc.get("kv_channels") or tc["hidden_size"] // heads,
                                  sections["model"]["vocab_size"],
                                  bool(sections["gpt_model"].get("share_embeddings_and_output_weights", False)))
        freq = tc.get("moe_layer_freq")  # a list: which layers are MoE ones, the others dense
        moe_layers = {i for i, moe in enumerate(freq) if moe} if isinstance(freq, list) else None
        items = []
        for item in self.weights:
            names = item.names().values()
            layers = range(tc["num_layers"]) if any("{layer}" in n for n in names) else [None]
            if moe_layers is not None and ".mlp." in item.megatron:
                layers = [i for i in layers if (i in moe_layers) == any(p in item.megatron for p in MOE_MLP)]
            experts = range(tc.get("num_moe_experts") or 0) if any("{expert}" in n for n in names) else [None]
            items += [item.expand(layer, expert) for layer in layers for expert in experts]
        return [i for i in items if not (geometry.tied and i.megatron == "output_layer.weight")], geometry

    def to_megatron_state_dict(self, hf_config: dict, hf_state: dict) -> dict:
        """Whole (unsharded, TP=1 names) Megatron-Core tensors from an HF state dict. Optional HF tensors the model
        lacks are skipped (and lm_head when the embeddings are tied); vocabulary padding is the caller's (Megatron
        pads the embedding rows to a multiple of 128 x TP)."""
        items, geometry = self.weight_table(hf_config)
        return {item.megatron: item.to_megatron(hf_state.__getitem__, geometry) for item in items
                if not item.absent_from(hf_state)}

    def to_hf_state_dict(self, hf_config: dict, megatron_state: dict) -> dict:
        """The reverse of `to_megatron_state_dict`: HF tensors (in the table's order) from whole Megatron-Core
        tensors, fused tensors split back and the vocabulary padding cut off."""
        items, geometry = self.weight_table(hf_config)
        state, stacker = {}, Stacker(items)
        for item in items:
            if not (item.optional and item.megatron not in megatron_state):
                for name, piece in item.to_hf(megatron_state[item.megatron], geometry).items():
                    whole = stacker.add(name, piece)
                    if whole is not None:
                        state[whole[0]] = whole[1]
        return state


# -- merge / split of whole tensors, shared by the typed mappings -------------------------------------------------

def merge_qkv(q, k, v, num_heads: int, num_groups: int, head_dim: int):
    """[q; k; v] projections (weights [out, in] or biases [out]) -> Megatron's per-group interleaving
    [q_g0 (heads/groups heads), k_g0, v_g0, q_g1, ...]."""
    import torch

    per_group = num_heads // num_groups
    rest = q.shape[1:]
    q = q.reshape(num_groups, per_group * head_dim, *rest)
    k = k.reshape(num_groups, head_dim, *rest)
    v = v.reshape(num_groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(num_groups * (per_group + 2) * head_dim, *rest)


def split_qkv(qkv, num_heads: int, num_groups: int, head_dim: int):
    """Megatron's interleaved linear_qkv -> (q, k, v)."""
    per_group = num_heads // num_groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(num_heads * head_dim, *rest), k.reshape(num_groups * head_dim, *rest),
            v.reshape(num_groups * head_dim, *rest))


def merge_gated(gate, up):
    import torch

    return torch.cat([gate, up], dim=0)


def split_gated(fc1):
    return fc1.chunk(2, dim=0)
