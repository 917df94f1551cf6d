"""Parameter counts equal, to the parameter, what transformers instantiates on the meta device."""

import random

import pytest

torch = pytest.importorskip("torch")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from toolkit.estimate.params import count_params  # noqa: E402
from toolkit.spec.model import spec_from_hf_dict  # noqa: E402


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
    if family == "qwen3_moe":
        kw.update(num_experts=rng.choice([2, 4, 8]), num_experts_per_tok=2, moe_intermediate_size=rng.choice([16, 24]),
                  decoder_sparse_step=rng.choice([1, 2]), mlp_only_layers=rng.sample(range(layers), rng.randint(0, layers)))
    return AutoConfig.for_model(family, **kw)


FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "phi3", "gpt2", "gpt_neox", "opt"]


def _expert_param_count(model) -> tuple[int, int]:
    """(total params inside routed-expert modules, number of experts per layer) from module names."""
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
