"""The model spec: one typed description of a decoder-only transformer, and where it is read from."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from toolkit.errors import UserInputError
from toolkit.families import family_for
from toolkit.numeric import FINITE
from toolkit.readers import not_a_file, one_line, read_json, read_yaml

T = TypeVar("T")

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets" / "models"

Activation = Literal["swiglu", "geglu", "gelu", "relu"]
GATED_ACTIVATIONS = ("swiglu", "geglu")


class ModelSpec(BaseModel):
    """Architecture fields that parameter counts, memory and FLOPs are computed from."""

    model_config = ConfigDict(extra="forbid", frozen=True, **FINITE)

    name: str = Field("custom", description="Display name (preset name, hub id or file).")
    family: str = Field("custom", description="HF model_type the spec was read from, or 'custom'.")
    num_layers: int = Field(gt=0, description="Transformer blocks.")
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0, description="Key/value heads (GQA); equal to attention heads for MHA.")
    head_dim: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0, description="MLP inner size of dense layers.")
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(2048, gt=0)
    tie_embeddings: bool = Field(False, description="LM head shares the token embedding matrix.")
    activation: Activation = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_affine: bool = Field(True, description="Norms have a learnable weight (and a bias for layernorm).")
    norms_per_layer: int = Field(2, ge=0, description="Norm modules in each block (gemma2 has 4).")
    final_norm: bool = True
    position_embedding: Literal["rope", "learned"] = "rope"
    rope_attention_factor: float = Field(
        1.0, gt=0, description="YaRN's attention factor (mscale) multiplying the rotary cos and sin (gpt_oss: "
                               "0.1 ln(factor) + 1); Transformer Engine's fused RoPE takes none but 1."
    )
    position_embedding_rows: int = Field(
        0, ge=0, description="Rows of a learned position table (max positions plus any offset, opt adds 2)."
    )
    qk_norm: bool = Field(False, description="Per-head RMSNorm on queries and keys (qwen3).")
    qkv_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = False
    embed_proj_dim: int | None = Field(
        None, description="Token embedding width when it differs from hidden_size (opt project_in/out)."
    )
    parallel_residual: bool = Field(False, description="Attention and MLP read the same input (gpt_neox).")
    num_experts: int = Field(0, ge=0, description="Routed experts per MoE layer; 0 for a dense model.")
    experts_top_k: int = Field(0, ge=0)
    moe_ffn_hidden_size: int | None = Field(None, gt=0, description="Inner size of one expert's MLP.")
    moe_layers: tuple[int, ...] | None = Field(
        None, description="Indices of MoE layers; None means every layer when num_experts > 0."
    )
    shared_expert_ffn_hidden_size: int = Field(
        0, ge=0, description="Inner size of the shared experts every token of an MoE layer passes (deepseek_v3: "
                             "n_shared_experts x moe_intermediate_size); 0 for none."
    )
    expert_bias: bool = Field(False, description="Each routed expert's projections carry biases (gpt_oss).")
    activation_clamp: float | None = Field(
        None, gt=0, description="GPT-OSS's SwiGLU: gate clamped above, the linear half to +-this (swiglu_limit), "
                                "gate x sigmoid(alpha x gate) x (linear + 1)."
    )
    router_bias: bool = Field(False, description="The router's logits carry a learned bias (gpt_oss).")
    moe_router_score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="The router's score function (deepseek_v3: sigmoid)."
    )
    moe_router_expert_bias: bool = Field(
        False, description="DeepSeek-V3's e_score_correction_bias: a per-expert fp32 buffer added to the scores for "
                           "the choice only, moved by load instead of an auxiliary loss (no parameter, no gradient)."
    )
    moe_router_groups: int | None = Field(
        None, gt=0, description="Group-limited routing: experts in this many groups (deepseek_v3 n_group)."
    )
    moe_router_group_topk: int | None = Field(
        None, gt=0, description="Groups each token's experts are chosen from (deepseek_v3 topk_group)."
    )
    q_lora_rank: int | None = Field(
        None, gt=0, description="Multi-latent attention: queries' compressed width; None projects them directly."
    )
    kv_lora_rank: int | None = Field(
        None, gt=0, description="Multi-latent attention (deepseek_v3) when set: keys' and values' compressed width. "
                                "head_dim is then the query/key head width (qk_nope_head_dim + qk_rope_head_dim)."
    )
    qk_rope_head_dim: int = Field(0, ge=0, description="MLA: the rotary part of each query/key head.")
    v_head_dim: int | None = Field(None, gt=0, description="MLA: each value head's width (head_dim when None).")
    mtp_layers: int = Field(
        0, ge=0, description="Multi-token prediction modules (num_nextn_predict_layers): Megatron-Core trains them; "
                             "transformers' model does not build them, so counts and FLOPs under HF Trainer omit them."
    )
    attention_sinks: bool = Field(False, description="A learned sink logit per attention head (gpt_oss).")
    sliding_window: int | None = Field(
        None, gt=0, description="Tokens a sliding-window layer attends to (itself included), in sliding_layers."
    )
    sliding_layers: tuple[int, ...] | None = Field(
        None, description="Indices of sliding-window layers; None means every layer when sliding_window is set."
    )
    hidden_dropout: float = Field(0.0, ge=0, lt=1, description="Residual/embedding dropout (keeps masks).")
    attention_dropout: float = Field(0.0, ge=0, lt=1)
    hf_activation: str | None = Field(None, description="transformers' activation name, when read from HF.")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_attention_heads={self.num_attention_heads}"
            )
        if self.num_experts:
            if not 0 < self.experts_top_k <= self.num_experts:
                raise ValueError(f"experts_top_k must be in 1..num_experts={self.num_experts}")
            if self.moe_ffn_hidden_size is None:
                raise ValueError("moe_ffn_hidden_size is required when num_experts > 0")
        if (self.moe_router_groups is None) != (self.moe_router_group_topk is None):
            raise ValueError("moe_router_groups and moe_router_group_topk are set together")
        if self.moe_router_groups and (self.num_experts % self.moe_router_groups
                                       or self.moe_router_group_topk > self.moe_router_groups):
            raise ValueError(f"moe_router_groups={self.moe_router_groups} must divide num_experts={self.num_experts} "
                             f"and be at least moe_router_group_topk={self.moe_router_group_topk}")
        if self.kv_lora_rank is None and (self.q_lora_rank or self.qk_rope_head_dim or self.v_head_dim):
            raise ValueError("q_lora_rank, qk_rope_head_dim and v_head_dim are multi-latent attention's: set "
                             "kv_lora_rank too")
        if self.kv_lora_rank is not None and not 0 < self.qk_rope_head_dim < self.head_dim:
            raise ValueError(f"multi-latent attention needs 0 < qk_rope_head_dim < head_dim={self.head_dim}")
        if self.position_embedding == "learned" and not self.position_embedding_rows:
            raise ValueError("position_embedding_rows is required for learned position embeddings")
        return self

    @property
    def gated_mlp(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        if not self.num_experts:
            return False
        flags = moe_layer_flags(self)
        return flags[index] if 0 <= index < len(flags) else self.moe_layers is None or index in self.moe_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V2/V3, Kimi K2)."""
        return self.kv_lora_rank is not None

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    def attention_window(self, index: int) -> int | None:
        """Tokens layer `index` attends to at most (its sliding window), None for full causal attention."""
        if self.sliding_window is None or (self.sliding_layers is not None and index not in self.sliding_layers):
            return None
        return self.sliding_window


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


# A hub id as the hub spells it: `owner/name`, letters, digits, `-`, `_`, `.`
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
SPEC_SUFFIXES = (".json", ".yaml", ".yml")


def looks_local(source: str) -> bool:
    """Whether a --model value names a path and never a hub id: it starts with `.`, `/` or `~`, ends like a spec file,
    or is not `owner/name` as the hub spells ids."""
    return source.startswith((".", "/", "~")) or source.endswith(SPEC_SUFFIXES) or not _HUB_ID.fullmatch(source)


def load_model_spec(source: str) -> ModelSpec:
    """Read a model from a preset name, an HF config.json (file or directory), a toolkit YAML/JSON spec, or a hub id.
    Something there that is neither file nor directory (a FIFO, a device), or a path that looks local and is not
    there, is one line: only an `owner/name` that is no path goes to the hub."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):  # one that is there but no file: read_json says what it is
            raise UserInputError("--model", f"directory {source} holds no config.json")
        return spec_from_hf_dict(_read_json(path / "config.json"), name=path.name)
    if os.path.lexists(path) and not path.is_file():
        raise UserInputError("--model", f"{source} is {not_a_file(path) or 'unreadable'}, not a file or a directory; expected an HF "
                                        f"config.json, a directory holding one, a toolkit model spec or a preset")
    if path.is_file():
        if path.suffix in (".yaml", ".yml"):
            return _from_toolkit_dict(_read_yaml(path), source)
        data = _read_json(path)
        if "model_type" in data:
            return spec_from_hf_dict(data, name=path.stem if path.name != "config.json" else path.parent.name)
        return _from_toolkit_dict(data, source)
    if (PRESET_DIR / f"{source}.json").is_file():
        return spec_from_hf_dict(_read_json(PRESET_DIR / f"{source}.json"), name=source)
    if not looks_local(source):
        return _from_hub(source)
    raise UserInputError(
        "--model",
        f"'{source}' is not a file, a directory with config.json, a hub id (owner/name) or a preset; "
        f"presets: {', '.join(preset_names())}",
    )


def _read_json(path: Path) -> dict:
    return read_json(path, what="an HF config.json or a toolkit model spec (a JSON object)")


def _read_yaml(path: Path) -> dict:
    return read_yaml(path, what="a toolkit model spec (a YAML mapping)")


def _from_toolkit_dict(data: dict, source: str) -> ModelSpec:
    if isinstance(data.get("model"), dict) and ({"training", "cluster", "plan"} & set(data)):
        raise UserInputError("--model", f"{source} is a recipe, not a model spec: give the model itself (a preset, an "
                                        f"HF config.json or a toolkit model spec), or `dmt generate {source} --out DIR` "
                                        f"for the recipe's plan")
    data = dict(data)
    data.setdefault("name", Path(source).stem)
    return validate_spec(data, source)


def validate_spec(data: dict, source: str) -> ModelSpec:
    """Build a ModelSpec, turning pydantic's errors into one line naming the key."""
    try:
        return ModelSpec(**data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "spec"
        raise UserInputError(f"{source}: {key}", err["msg"]) from None


# HF config sizes that must be positive when given (the family readers and transformers divide by several of them).
_POSITIVE_HF_KEYS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "vocab_size", "max_position_embeddings", "n_layer", "n_embd", "n_head", "n_positions", "ffn_dim",
    "moe_intermediate_size", "num_experts_per_tok", "decoder_sparse_step", "kv_lora_rank", "qk_rope_head_dim",
    "v_head_dim", "n_group", "topk_group",
)


def spec_from_hf_dict(data: dict, name: str, filled: bool = False) -> ModelSpec:
    """A ModelSpec from the contents of an HF config.json, read by its family's reader from the dict itself. Only a
    config that leaves a key the reader needs to transformers' defaults imports transformers (1.5 s) to fill them
    in; `filled`: the dict is a transformers config's `to_dict()`, defaults filled in already."""
    family = family_for(data.get("model_type"), f"{name}: model_type")
    for key in _POSITIVE_HF_KEYS:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise UserInputError(f"{name}: {key}", f"must be a positive integer, got {value}")
    fields = family.spec_fields(data, name, library_config=None if filled else
                                lambda: _library_config({**data, "model_type": family.model_type}, name))
    return validate_spec({**fields, "name": name, "family": family.model_type}, name)


def _library_config(data: dict, name: str) -> dict:
    """The config dict with transformers' defaults filled in (and its own checks run)."""
    from transformers import AutoConfig

    model_type = data["model_type"]
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if k != "model_type"})
    except Exception as exc:  # transformers validates in __post_init__: ValueError, ZeroDivisionError, StrictDataclassError
        raise UserInputError(f"{name}", f"not a valid '{model_type}' config ({one_line(exc)})") from None
    return config.to_dict()


def _from_hub(hub_id: str) -> ModelSpec:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(hub_id)
    except Exception as exc:  # OSError offline / not found, ValueError and huggingface_hub validation errors
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1 is set)" if offline else ""
        raise UserInputError("--model", f"could not load hub config '{hub_id}'{hint}: {str(exc).splitlines()[0]}") from None
    return spec_from_hf_dict(config.to_dict(), hub_id, filled=True)


def by_identity(frozen: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """`function(*objects, *args)` memoised by the identity of its first `frozen` arguments (frozen pydantic models:
    a ModelSpec, a Plan) and the value of the (hashable) rest. A frozen object always gives the same answer; hashing
    one hashes every field, which costs more than most of what the estimators derive from it, and the plan search
    asks for those figures of every candidate. Each entry keeps its objects alive, so their ids name no others while
    the entry exists."""

    def decorate(function: Callable[..., T]) -> Callable[..., T]:
        cache: dict[tuple, tuple[tuple, T]] = {}

        def compute(key: tuple, objects: tuple, args: tuple, kwargs: dict) -> T:
            if len(cache) >= PER_MODEL_ENTRIES:
                cache.clear()
            cache[key] = (objects, value := function(*args, **kwargs))
            return value

        @functools.wraps(function)
        def memoised(*args, **kwargs) -> T:
            if frozen == 1 and not kwargs:  # the common case, kept short: it runs for every layer of every plan
                first = args[0]
                hit = cache.get(key := (id(first), *args[1:]))
                return hit[1] if hit is not None and hit[0][0] is first else compute(key, (first,), args, kwargs)
            if frozen == 2 and not kwargs:  # (spec, plan): every stage of every plan
                first, second = args[0], args[1]
                hit = cache.get(key := (id(first), id(second), *args[2:]))
                if hit is not None and hit[0][0] is first and hit[0][1] is second:
                    return hit[1]
                return compute(key, (first, second), args, kwargs)
            objects = args[:frozen]
            key = (*[id(a) for a in objects], *args[frozen:], *kwargs.items())
            hit = cache.get(key)
            if hit is not None and all(a is b for a, b in zip(hit[0], objects)):
                return hit[1]
            return compute(key, objects, args, kwargs)

        memoised.cache_clear = cache.clear  # type: ignore[attr-defined]
        return memoised

    return decorate


per_model = by_identity(1)  # function(spec, *args), by the spec's identity
PER_MODEL_ENTRIES = 8192  # per memoised function: a search's layouts of a few models, not a process's lifetime


@per_model
def moe_layer_flags(spec: ModelSpec) -> tuple[bool, ...]:
    """Whether each decoder layer is an MoE layer, as one tuple (the estimators ask of every layer of every plan)."""
    if not spec.num_experts:
        return (False,) * spec.num_layers
    moe = None if spec.moe_layers is None else frozenset(spec.moe_layers)
    return tuple(moe is None or i in moe for i in range(spec.num_layers))
