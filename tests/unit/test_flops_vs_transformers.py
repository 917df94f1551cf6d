"""FLOPs per token of each MoE family equal, layer by layer, what torch's FlopCounterMode counts in transformers' own
model running a forward on CPU: MLA's projections and head shapes, shared experts, dense first layers, the routed
experts' top k and the router, GPT-OSS's sliding-window layers, the output head."""

import pytest

torch = pytest.importorskip("torch")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from toolkit.estimate.flops import head_forward_flops, layer_forward_flops, model_flops_per_token  # noqa: E402
from toolkit.spec.model import spec_from_hf_dict  # noqa: E402

WINDOW = 4
CONFIGS = {
    "deepseek_v3-q_lora": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, intermediate_size=40,
                               q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2,
                               n_group=4, topk_group=2, first_k_dense_replace=1, num_nextn_predict_layers=1),
    "deepseek_v3-direct_q": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=40,
                                 q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                 v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                 n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
                                 attention_bias=True),
    "gpt_oss": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "qwen3_moe": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=40, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      mlp_only_layers=[0]),
    "mixtral": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
}


def _measured_per_token(model, seq: int) -> dict[str, float]:
    """FlopCounterMode's forward FLOPs per token of each decoder layer and of the output head."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, seq))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    counts = {name.split(".", 1)[1]: sum(ops.values()) for name, ops in counter.get_flop_counts().items()
              if "." in name}
    return {name: flops / ids.numel() for name, flops in counts.items()}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_layer_flops_equal_flop_counter_on_transformers_model(case):
    family = case.split("-")[0]
    config = AutoConfig.for_model(family, vocab_size=97, **CONFIGS[case])
    config._attn_implementation = "eager"  # QK^T and PV as matmuls the counter sees (the whole s x s matrix)
    config._experts_implementation = "eager"  # a matmul per expert over its routed tokens
    model = AutoModelForCausalLM.from_config(config).eval()
    spec = spec_from_hf_dict(config.to_dict(), case, filled=True)
    seq = 16
    long, short = _measured_per_token(model, seq), _measured_per_token(model, WINDOW)
    for i in range(spec.num_layers):
        ours = layer_forward_flops(spec, i, seq).total
        # a sliding layer attends WINDOW tokens however long the sequence: the eager model at seq == WINDOW runs it
        measured = (short if spec.attention_window(i) else long)[f"model.layers.{i}"]
        assert ours == pytest.approx(measured, rel=1e-12), f"layer {i}"
    assert head_forward_flops(spec) == pytest.approx(long["lm_head"], rel=1e-12)
    forward = sum(v for k, v in long.items() if k.count(".") == 2 and k.startswith("model.layers."))
    if not spec.sliding_window:
        assert model_flops_per_token(spec, seq) == pytest.approx(3 * (forward + long["lm_head"]), rel=1e-12)


def test_gpt_oss_sliding_layers_attend_the_window_only():
    spec = spec_from_hf_dict({"model_type": "gpt_oss", **CONFIGS["gpt_oss"], "vocab_size": 97}, "gpt_oss")
    sliding, full = layer_forward_flops(spec, 0, 4096), layer_forward_flops(spec, 1, 4096)
    assert sliding.matmul == full.matmul
    assert sliding.attention * 4096 == full.attention * WINDOW


def test_mtp_adds_its_block_projection_and_head_where_trained():
    """DeepSeek-V3's MTP module: eh_proj (2h -> h), one MoE block like the last layer, the shared output head, forward
    and backward; transformers' model has none, so the count under HF Trainer leaves it out."""
    spec = spec_from_hf_dict({"model_type": "deepseek_v3", **CONFIGS["deepseek_v3-q_lora"], "vocab_size": 97}, "mtp")
    s, h = 64, spec.hidden_size
    extra = model_flops_per_token(spec, s, mtp=True) - model_flops_per_token(spec, s)
    last = layer_forward_flops(spec, spec.num_layers - 1, s).total
    assert spec.mtp_layers == 1 and spec.is_moe_layer(spec.num_layers - 1)
    assert extra == pytest.approx(3 * (4 * h * h + last + head_forward_flops(spec)), rel=1e-12)
