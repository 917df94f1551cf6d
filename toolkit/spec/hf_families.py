"""Readers from a transformers config object to a ModelSpec, one small table entry per HF model family."""

from __future__ import annotations

from typing import Any, Callable

from toolkit.errors import UserInputError
from toolkit.spec.model import ModelSpec, validate_spec

# HF activation names -> whether the MLP is gated decides swiglu/geglu vs gelu/relu.
_GELU_NAMES = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu")


def _activation(name: str, gated: bool) -> str:
    if name in ("silu", "swish"):
        return "swiglu" if gated else "gelu"
    if name in _GELU_NAMES:
        return "geglu" if gated else "gelu"
    if name == "relu":
        return "relu"
    raise UserInputError("hidden_act", f"activation '{name}' is not supported; expected silu, gelu or relu")


def _hidden_act(cfg: Any) -> str:
    return getattr(cfg, "hidden_act", None) or cfg.hidden_activation


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _llama_like(cfg: Any, **overrides: Any) -> dict:
    """Common fields of the llama lineage (llama, mistral, mixtral, qwen2/3, gemma2, phi3)."""
    fields = dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=_head_dim(cfg),
        ffn_hidden_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_embeddings=bool(cfg.tie_word_embeddings),
        activation=_activation(_hidden_act(cfg), gated=True),
        hf_activation=_hidden_act(cfg),
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        norm="rmsnorm",
        position_embedding="rope",
    )
    fields.update(overrides)
    return fields


def _llama(cfg: Any) -> dict:
    bias = bool(getattr(cfg, "attention_bias", False))
    return _llama_like(cfg, qkv_bias=bias, attn_out_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


def _mistral(cfg: Any) -> dict:
    return _llama_like(cfg)


def _mixtral(cfg: Any) -> dict:
    return _llama_like(
        cfg,
        num_experts=cfg.num_local_experts,
        experts_top_k=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.intermediate_size,
    )


def _qwen2(cfg: Any) -> dict:
    return _llama_like(cfg, qkv_bias=True)


def _qwen3(cfg: Any) -> dict:
    bias = bool(cfg.attention_bias)
    return _llama_like(cfg, qkv_bias=bias, attn_out_bias=bias, qk_norm=True)


def _qwen3_moe(cfg: Any) -> dict:
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
    step = cfg.decoder_sparse_step
    skip = set(cfg.mlp_only_layers or ())
    moe_layers = tuple(i for i in range(cfg.num_hidden_layers) if i not in skip and num_experts > 0 and (i + 1) % step == 0)
    fields = _qwen3(cfg)
    fields.update(
        num_experts=num_experts,
        experts_top_k=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_layers=moe_layers,
    )
    if not moe_layers:
        fields.update(num_experts=0, experts_top_k=0, moe_ffn_hidden_size=None, moe_layers=None)
    return fields


def _gemma2(cfg: Any) -> dict:
    bias = bool(cfg.attention_bias)
    return _llama_like(cfg, qkv_bias=bias, attn_out_bias=bias, norms_per_layer=4)


def _phi3(cfg: Any) -> dict:
    return _llama_like(cfg)


def _gpt2(cfg: Any) -> dict:
    return dict(
        num_layers=cfg.n_layer,
        hidden_size=cfg.n_embd,
        num_attention_heads=cfg.n_head,
        num_kv_heads=cfg.n_head,
        head_dim=cfg.n_embd // cfg.n_head,
        ffn_hidden_size=cfg.n_inner or 4 * cfg.n_embd,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.n_positions,
        tie_embeddings=bool(cfg.tie_word_embeddings),
        activation=_activation(cfg.activation_function, gated=False),
        hf_activation=cfg.activation_function,
        hidden_dropout=float(max(cfg.resid_pdrop, cfg.embd_pdrop)),
        attention_dropout=float(cfg.attn_pdrop),
        norm="layernorm",
        position_embedding="learned",
        position_embedding_rows=cfg.n_positions,
        qkv_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
    )


def _gpt_neox(cfg: Any) -> dict:
    bias = bool(cfg.attention_bias)
    return dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_attention_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_embeddings=bool(cfg.tie_word_embeddings),
        activation=_activation(cfg.hidden_act, gated=False),
        hf_activation=cfg.hidden_act,
        hidden_dropout=float(cfg.hidden_dropout),
        attention_dropout=float(cfg.attention_dropout),
        norm="layernorm",
        position_embedding="rope",
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=True,
        parallel_residual=bool(cfg.use_parallel_residual),
    )


def _opt(cfg: Any) -> dict:
    offset = 2  # OPTLearnedPositionalEmbedding keeps two extra rows
    return dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_attention_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_embeddings=bool(cfg.tie_word_embeddings),
        activation=_activation(cfg.activation_function, gated=False),
        hf_activation=cfg.activation_function,
        hidden_dropout=float(cfg.dropout),
        attention_dropout=float(cfg.attention_dropout),
        norm="layernorm",
        norm_affine=bool(cfg.layer_norm_elementwise_affine),
        final_norm=bool(cfg.do_layer_norm_before and not cfg._remove_final_layer_norm),
        position_embedding="learned",
        position_embedding_rows=cfg.max_position_embeddings + offset,
        qkv_bias=bool(cfg.enable_bias),
        attn_out_bias=bool(cfg.enable_bias),
        mlp_bias=bool(cfg.enable_bias),
        embed_proj_dim=cfg.word_embed_proj_dim if cfg.word_embed_proj_dim != cfg.hidden_size else None,
    )


FAMILY_READERS: dict[str, Callable[[Any], dict]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gemma2": _gemma2,
    "phi3": _phi3,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
}


def spec_from_hf_config(cfg: Any, name: str) -> ModelSpec:
    """Translate a transformers PretrainedConfig of a supported family into a ModelSpec."""
    reader = FAMILY_READERS.get(cfg.model_type)
    if reader is None:
        raise UserInputError(
            f"{name}: model_type",
            f"family '{cfg.model_type}' is not supported; supported: {', '.join(sorted(FAMILY_READERS))}",
        )
    try:
        fields = reader(cfg)
    except UserInputError:
        raise
    except AttributeError as exc:
        raise UserInputError(f"{name}", f"config of family '{cfg.model_type}' lacks a field ({exc})") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:  # e.g. decoder_sparse_step 0, a null size
        raise UserInputError(f"{name}", f"invalid config of family '{cfg.model_type}' ({exc})") from None
    fields.update(name=name, family=cfg.model_type)
    return validate_spec(fields, name)
