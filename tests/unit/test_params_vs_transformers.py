"""Parameter counts equal, to the parameter, what transformers instantiates on the meta device."""

import json
import random

import pytest

torch = pytest.importorskip("torch")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from toolkit.estimate.params import count_params  # noqa: E402
from toolkit.spec.model import PRESET_DIR, load_model_spec, preset_names, spec_from_hf_dict  # noqa: E402


def _random_config(family: str, rng: random.Random):
    heads = rng.choice([2, 4, 6, 8])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    hidden = heads * rng.choice([8, 16, 24])
    vocab = rng.choice([97, 128, 1000])
    common = dict(vocab_size=vocab, tie_word_embeddings=rng.random() < 0.5, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    layers = rng.randint(1, 4)
    ffn = rng.choice([32, 56, 96])
    if family == "gpt2":
        return AutoConfig.for_model(family, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=rng.choice([64, 128]),
                                    n_inner=rng.choice([None, ffn]), **common)
    if family == "opt":
        proj = rng.choice([hidden, hidden // 2])
        return AutoConfig.for_model(family, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                    ffn_dim=ffn, word_embed_proj_dim=proj, max_position_embeddings=rng.choice([64, 100]),
                                    enable_bias=rng.random() < 0.5, do_layer_norm_before=rng.random() < 0.7,
                                    layer_norm_elementwise_affine=rng.random() < 0.8, **common)
    if family == "gpt_neox":
        return AutoConfig.for_model(family, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                    intermediate_size=ffn, attention_bias=rng.random() < 0.5,
                                    use_parallel_residual=rng.random() < 0.5, **common)
    kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
              intermediate_size=ffn, **common)
    if family in ("llama", "qwen3", "gemma2", "qwen3_moe"):
        kw["attention_bias"] = rng.random() < 0.5
        kw["head_dim"] = rng.choice([hidden // heads, 8, 32])
    if family == "llama":
        kw["mlp_bias"] = rng.random() < 0.5
    if family == "mixtral":
        kw.update(num_local_experts=rng.choice([2, 4, 8]), num_experts_per_tok=2)
    if family == "deepseek_v3":
        kw.pop("num_key_value_heads")  # MLA: the heads
        experts = rng.choice([4, 8])
        groups = rng.choice([d for d in (1, 2, 4) if experts % d == 0])
        kw.update(q_lora_rank=rng.choice([None, 16, 24]), kv_lora_rank=rng.choice([8, 16]),
                  qk_nope_head_dim=rng.choice([8, 16]), qk_rope_head_dim=rng.choice([4, 8]),
                  v_head_dim=rng.choice([8, 12, 16]), n_routed_experts=experts, num_experts_per_tok=2,
                  moe_intermediate_size=rng.choice([16, 24]), n_shared_experts=rng.choice([1, 2]), n_group=groups,
                  topk_group=rng.randint(1, groups), first_k_dense_replace=rng.randint(0, layers),
                  attention_bias=rng.random() < 0.5, num_nextn_predict_layers=rng.choice([0, 1]))
    if family == "gpt_oss":
        kw.update(num_local_experts=rng.choice([2, 4, 8]), num_experts_per_tok=2, head_dim=rng.choice([8, 16]),
                  attention_bias=rng.random() < 0.5, sliding_window=rng.choice([4, 128]),
                  layer_types=[rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)])
    if family == "qwen3_moe":
        kw.update(num_experts=rng.choice([2, 4, 8]), num_experts_per_tok=2, moe_intermediate_size=rng.choice([16, 24]),
                  decoder_sparse_step=rng.choice([1, 2]), mlp_only_layers=rng.sample(range(layers), rng.randint(0, layers)))
    return AutoConfig.for_model(family, **kw)


FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma2", "phi3", "gpt2",
            "gpt_neox", "opt"]


def _expert_param_count(model) -> int:
    """Parameters inside routed-expert modules, from module names (a shared expert is `shared_experts`)."""
    total = 0
    for name, param in model.named_parameters():
        if ".experts." in name or name.endswith(".experts"):
            total += param.numel()
    return total


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(6))
def test_param_count_matches_transformers_meta_model(family, seed):
    rng = random.Random(f"{family}-{seed}")
    config = _random_config(family, rng)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counts = count_params(spec_from_hf_dict(config.to_dict(), f"{family}-{seed}", filled=True))
    assert counts.total == model.num_parameters()
    assert counts.embedding == model.num_parameters() - model.num_parameters(exclude_embeddings=True)
    expert_total = _expert_param_count(model)
    if expert_total:
        e, k = counts.num_experts, counts.experts_top_k
        assert counts.active == counts.total - expert_total * (e - k) // e
    else:
        assert counts.active == counts.total


MOE_PRESETS = sorted(name for name in preset_names() if load_model_spec(name).is_moe)


def test_every_moe_family_has_a_preset_here():
    assert {load_model_spec(name).family for name in MOE_PRESETS} == {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"}


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_moe_preset_counts_match_transformers_meta_model(preset):
    """Total and active parameters of every MoE preset equal transformers' own model of its config.json, built on the
    meta device. Kimi K2's config.json says model_type kimi_k2 (remote code) and names DeepseekV3ForCausalLM, which
    transformers builds from the same keys; the fp8/mxfp4 quantization_config is left out (it changes storage, not
    the parameters)."""
    data = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    spec = load_model_spec(preset)
    keys = {k: v for k, v in data.items() if k not in ("model_type", "quantization_config", "auto_map", "_dmt_source")}
    config = AutoConfig.for_model(spec.family, **keys)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counts = count_params(spec)
    assert counts.total == model.num_parameters()
    e, k = counts.num_experts, counts.experts_top_k
    assert counts.active == counts.total - _expert_param_count(model) * (e - k) // e
    assert counts.embedding == model.num_parameters() - model.num_parameters(exclude_embeddings=True)
    assert counts.mtp_layers == () or not any(".layers.%d." % spec.num_layers in n for n, _ in model.named_parameters())
