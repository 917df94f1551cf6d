"""HF <-> Megatron-Core mappings as data: config fields and weight names per family, and the engine that applies them.

Each family module (llama.py, qwen2.py, ...) only declares a `FamilyMapping`: which HF config key feeds which Megatron
field (with HF's default for an absent key and a transform each way), which Megatron choices the family fixes
(normalization, activation, biases), and which HF weight feeds which Megatron-Core weight (1:1 renames, or the typed
merges `QKV` and `GatedMLP` whose split/merge helpers live here). The generator (megatron.yaml) reads the config
side; the checkpoint converter reads both sides of the same tables.

Megatron-side names are `section.field`: `transformer_config.*` are `TransformerConfig` fields, `gpt_model.*` are
`GPTModel` arguments, and `model.vocab_size` is the tokenizer's vocabulary before Megatron pads it.
Weight names are those of Megatron-Core's local layer spec (`get_gpt_layer_local_spec`); `TE_FUSED_NORMS` gives the
Transformer Engine spec's names of the two pre-norms, which dist checkpoints of either spec use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from toolkit.errors import UserInputError

FAMILY_MODULES = {"llama": "llama", "mistral": "mistral", "mixtral": "mixtral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "qwen3_moe": "qwen3", "gpt2": "gpt2"}
REQUIRED = object()  # a Field default: the HF config must have the key

# local-spec pre-norm names -> the Transformer Engine spec's (norms fused into the following linear layer)
TE_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


@dataclass(frozen=True)
class Field:
    """One HF config key and the Megatron field it feeds. `default` is HF's value when the key is absent (a callable
    gets the whole HF dict); `to_megatron` / `to_hf` transform the value each way (identity when None)."""

    hf: str
    megatron: str
    default: Any = REQUIRED
    to_megatron: Callable[[Any], Any] | None = None
    to_hf: Callable[[Any], Any] | None | bool = None  # False: not written back (another field owns the HF key)


@dataclass(frozen=True)
class Unsupported:
    """An HF setting Megatron-Core cannot express for this family: `when(value)` is true for the offending values."""

    hf: str
    when: Callable[[Any], bool]
    reason: str


@dataclass(frozen=True)
class Rename:
    """One HF weight is one Megatron weight (`transpose` for GPT-2's Conv1D, which stores [in, out])."""

    hf: str
    megatron: str
    transpose: bool = False


@dataclass(frozen=True)
class QKV:
    """Separate q/k/v projections (weights or biases) <-> Megatron's linear_qkv, interleaved per query group."""

    q: str
    k: str
    v: str
    megatron: str


@dataclass(frozen=True)
class FusedQKV:
    """One HF tensor holding [q; k; v] (GPT-2's c_attn, Conv1D when `transpose`) <-> Megatron's linear_qkv."""

    hf: str
    megatron: str
    transpose: bool = False


@dataclass(frozen=True)
class GatedMLP:
    """HF gate and up projections <-> Megatron's linear_fc1, which holds [gate; up] along the output dimension."""

    gate: str
    up: str
    megatron: str


WeightMapping = Rename | QKV | FusedQKV | GatedMLP


@dataclass(frozen=True)
class FamilyMapping:
    family: str  # HF model_type
    architecture: str  # HF architectures[0], written back by the converter
    fields: tuple[Field, ...]
    fixed: dict = field(default_factory=dict)  # Megatron fields the family fixes, `section.field` -> value
    unsupported: tuple[Unsupported, ...] = ()
    weights: tuple[WeightMapping, ...] = ()  # names may hold {layer} and {expert}


def mapping_for(family: str) -> FamilyMapping:
    """The mapping of an HF model_type; a UserInputError naming the supported ones otherwise."""
    if family not in FAMILY_MODULES:
        raise UserInputError("model.source", f"no Megatron-Core mapping for model family '{family}'; supported: "
                                             f"{', '.join(sorted(FAMILY_MODULES))}")
    module = importlib.import_module(f"toolkit.mappings.{FAMILY_MODULES[family]}")
    return next(m for m in module.MAPPINGS if m.family == family)


def megatron_fields(hf_config: dict) -> dict[str, dict]:
    """Megatron sections (`{"transformer_config": {...}, "gpt_model": {...}, "model": {...}}`) of an HF config dict."""
    family = hf_config.get("model_type")
    mapping = mapping_for(family)
    for rule in mapping.unsupported:
        if rule.hf in hf_config and rule.when(hf_config[rule.hf]):
            raise UserInputError(f"model.config.{rule.hf}", f"{hf_config[rule.hf]!r}: {rule.reason}")
    sections: dict[str, dict] = {}
    for item in mapping.fields:
        value = hf_config.get(item.hf, item.default)
        if value is REQUIRED:
            raise UserInputError(f"model.config.{item.hf}", f"is required for a {family} model")
        if callable(value) and item.hf not in hf_config:
            value = value(hf_config)
        if item.to_megatron is not None:
            value = item.to_megatron(value)
        section, name = item.megatron.split(".", 1)
        sections.setdefault(section, {})[name] = value
    for key, value in mapping.fixed.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    return sections


def hf_fields(family: str, sections: dict[str, dict]) -> dict:
    """The reverse direction: HF config keys from Megatron sections (for a converter writing config.json)."""
    mapping = mapping_for(family)
    config = {"model_type": family, "architectures": [mapping.architecture]}
    for item in mapping.fields:
        section, name = item.megatron.split(".", 1)
        if item.to_hf is not False and name in sections.get(section, {}):
            value = sections[section][name]
            config[item.hf] = item.to_hf(value) if item.to_hf is not None else value
    return config


def expand_weights(mapping: FamilyMapping, num_layers: int, num_experts: int = 0) -> list[WeightMapping]:
    """The family's weight mappings with {layer} (and {expert}) filled in: one entry per concrete tensor."""
    import dataclasses

    concrete = []
    for item in mapping.weights:
        names = [getattr(item, f.name) for f in dataclasses.fields(item) if isinstance(getattr(item, f.name), str)]
        layers = range(num_layers) if any("{layer}" in n for n in names) else [None]
        experts = range(num_experts) if any("{expert}" in n for n in names) else [None]
        for layer in layers:
            for expert in experts:
                concrete.append(dataclasses.replace(item, **{
                    f.name: getattr(item, f.name).format(layer=layer, expert=expert)
                    for f in dataclasses.fields(item) if isinstance(getattr(item, f.name), str)}))
    return concrete


@dataclass(frozen=True)
class WeightGeometry:
    """What the typed transforms need to know of a model: attention layout and the vocabulary before padding."""

    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool  # output_layer shares the embedding (no lm_head on the HF side)


def weight_table(hf_config: dict) -> tuple[list[WeightMapping], WeightGeometry]:
    """One mapping per concrete tensor of this model ({layer}/{expert} filled in, output_layer left out when the
    embeddings are tied) and the geometry `megatron_tensor` / `hf_tensors` need."""
    sections = megatron_fields(hf_config)
    tc = sections["transformer_config"]
    heads = tc["num_attention_heads"]
    geometry = WeightGeometry(heads, tc["num_query_groups"], tc.get("kv_channels") or tc["hidden_size"] // heads,
                              sections["model"]["vocab_size"],
                              bool(sections["gpt_model"].get("share_embeddings_and_output_weights", False)))
    items = expand_weights(mapping_for(hf_config["model_type"]), tc["num_layers"], tc.get("num_moe_experts") or 0)
    return [i for i in items if not (geometry.tied and i.megatron == "output_layer.weight")], geometry


def hf_names(item: WeightMapping) -> tuple[str, ...]:
    """The HF tensors one mapping reads or writes."""
    if isinstance(item, QKV):
        return item.q, item.k, item.v
    if isinstance(item, GatedMLP):
        return item.gate, item.up
    return (item.hf,)


def megatron_tensor(item: WeightMapping, read: Callable[[str], Any], geometry: WeightGeometry):
    """One whole (TP=1 name, unpadded) Megatron-Core tensor from the HF tensors `read(name)` returns. Works on meta
    tensors too, which is how the converter learns shapes without reading data."""
    g = geometry
    if isinstance(item, Rename):
        return read(item.hf).t() if item.transpose else read(item.hf)
    if isinstance(item, QKV):
        return merge_qkv(read(item.q), read(item.k), read(item.v), g.heads, g.groups, g.head_dim)
    if isinstance(item, FusedQKV):
        fused = read(item.hf).t() if item.transpose else read(item.hf)
        q, k, v = fused.split([g.heads * g.head_dim, g.groups * g.head_dim, g.groups * g.head_dim], dim=0)
        return merge_qkv(q, k, v, g.heads, g.groups, g.head_dim)
    return merge_gated(read(item.gate), read(item.up))


def hf_tensors(item: WeightMapping, tensor, geometry: WeightGeometry) -> dict:
    """The HF tensors of one whole Megatron-Core tensor: fused tensors split back, the vocabulary padding cut off."""
    g = geometry
    if isinstance(item, Rename):
        if item.megatron in ("embedding.word_embeddings.weight", "output_layer.weight"):
            tensor = tensor[: g.vocab]
        return {item.hf: tensor.t().contiguous() if item.transpose else tensor}
    if isinstance(item, QKV):
        return dict(zip(hf_names(item), (t.contiguous() for t in split_qkv(tensor, g.heads, g.groups, g.head_dim))))
    if isinstance(item, FusedQKV):
        import torch

        fused = torch.cat(split_qkv(tensor, g.heads, g.groups, g.head_dim), dim=0)
        return {item.hf: fused.t().contiguous() if item.transpose else fused}
    return dict(zip(hf_names(item), (t.contiguous() for t in split_gated(tensor))))


def to_megatron_state_dict(hf_config: dict, hf_state: dict) -> dict:
    """Whole (unsharded, TP=1 names) Megatron-Core tensors from an HF state dict, by the family's table. HF tensors
    the table names but the model lacks are skipped (and lm_head when the embeddings are tied); vocabulary padding is
    the caller's (Megatron pads the embedding rows to a multiple of 128 x TP)."""
    items, geometry = weight_table(hf_config)
    return {item.megatron: megatron_tensor(item, hf_state.__getitem__, geometry) for item in items
            if not (isinstance(item, Rename) and item.hf not in hf_state)}


def to_hf_state_dict(hf_config: dict, megatron_state: dict) -> dict:
    """The reverse of `to_megatron_state_dict`: HF tensors (in the table's order) from whole Megatron-Core tensors,
    fused tensors split back and the vocabulary padding cut off."""
    items, geometry = weight_table(hf_config)
    state = {}
    for item in items:
        if not (isinstance(item, Rename) and item.megatron not in megatron_state):
            state.update(hf_tensors(item, megatron_state[item.megatron], geometry))
    return state


# -- merge / split helpers of the typed mappings (the engine owns TP/PP sharding; these see whole tensors) --------

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


# -- transforms shared by the family tables ----------------------------------------------------------------------

def rope_theta(hf_config: dict, default: float):
    """rope_theta, also where transformers 5 writes it (`rope_parameters`)."""
    params = hf_config.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf_config.get("rope_theta", default)))


def rope_scaling_enabled(value) -> bool:
    """Megatron-Core's `rope_scaling` is Llama 3.1's frequency scaling; other HF rope types have no equivalent here."""
    if not value:
        return False
    kind = value.get("rope_type", value.get("type"))
    if kind in (None, "default"):
        return False
    if kind != "llama3":
        raise UserInputError("model.config.rope_scaling", f"rope_type '{kind}' has no Megatron-Core GPTModel "
                                                          f"equivalent here (llama3 scaling is supported)")
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    changed = [f"{k}={value[k]}" for k, v in fixed.items() if k in value and float(value[k]) != v]
    if changed:  # Megatron-Core's RotaryEmbedding only takes the factor; the rest are Llama 3.1's constants
        raise UserInputError("model.config.rope_scaling", f"{', '.join(changed)}: Megatron-Core applies llama3 "
                                                          f"scaling with {fixed} only")
    return True


def rope_scaling_factor(value) -> float:
    return float((value or {}).get("factor", 8.0)) if rope_scaling_enabled(value) else 8.0


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "openai_gelu",
               "gelu_pytorch_tanh": "openai_gelu", "relu": "relu"}
HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "openai_gelu": "gelu_new", "relu": "relu"}


def activation(name: str) -> str:
    """HF activation name -> the name megatron.yaml stores (the builder maps it to the function)."""
    if name not in ACTIVATIONS:
        raise UserInputError("model.config.hidden_act", f"activation '{name}' has no Megatron-Core equivalent here; "
                                                        f"supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def llama_lineage_fields(eps_default: float, theta_default: float, tie_default: bool = False) -> tuple[Field, ...]:
    """Config fields the llama lineage (llama, mistral, mixtral, qwen2, qwen3) shares key for key."""
    return (
        Field("num_hidden_layers", "transformer_config.num_layers"),
        Field("hidden_size", "transformer_config.hidden_size"),
        Field("num_attention_heads", "transformer_config.num_attention_heads"),
        Field("num_key_value_heads", "transformer_config.num_query_groups", lambda hf: hf["num_attention_heads"]),
        Field("head_dim", "transformer_config.kv_channels",
              lambda hf: hf["hidden_size"] // hf["num_attention_heads"]),
        Field("intermediate_size", "transformer_config.ffn_hidden_size"),
        Field("rms_norm_eps", "transformer_config.layernorm_epsilon", eps_default, float),
        Field("initializer_range", "transformer_config.init_method_std", 0.02, float),
        Field("attention_dropout", "transformer_config.attention_dropout", 0.0, float),
        Field("hidden_act", "transformer_config.activation_func", "silu", activation, HF_ACTIVATIONS.get),
        Field("vocab_size", "model.vocab_size"),
        Field("max_position_embeddings", "gpt_model.max_sequence_length"),
        Field("rope_theta", "gpt_model.rotary_base", lambda hf: rope_theta(hf, theta_default), float),
        Field("tie_word_embeddings", "gpt_model.share_embeddings_and_output_weights", tie_default, bool),
    )


LLAMA_LINEAGE_FIXED = {
    "transformer_config.normalization": "RMSNorm",
    "transformer_config.gated_linear_unit": True,
    "transformer_config.add_bias_linear": False,
    "transformer_config.add_qkv_bias": False,
    "transformer_config.qk_layernorm": False,
    "transformer_config.hidden_dropout": 0.0,
    "gpt_model.position_embedding_type": "rope",
}

LLAMA_LINEAGE_WEIGHTS = (
    Rename("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    Rename("model.layers.{layer}.input_layernorm.weight", "decoder.layers.{layer}.input_layernorm.weight"),
    QKV("model.layers.{layer}.self_attn.q_proj.weight", "model.layers.{layer}.self_attn.k_proj.weight",
        "model.layers.{layer}.self_attn.v_proj.weight", "decoder.layers.{layer}.self_attention.linear_qkv.weight"),
    Rename("model.layers.{layer}.self_attn.o_proj.weight", "decoder.layers.{layer}.self_attention.linear_proj.weight"),
    Rename("model.layers.{layer}.post_attention_layernorm.weight", "decoder.layers.{layer}.pre_mlp_layernorm.weight"),
    Rename("model.norm.weight", "decoder.final_layernorm.weight"),
    Rename("lm_head.weight", "output_layer.weight"),  # absent when the embeddings are tied
)

DENSE_MLP_WEIGHTS = (
    GatedMLP("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight",
             "decoder.layers.{layer}.mlp.linear_fc1.weight"),
    Rename("model.layers.{layer}.mlp.down_proj.weight", "decoder.layers.{layer}.mlp.linear_fc2.weight"),
)
