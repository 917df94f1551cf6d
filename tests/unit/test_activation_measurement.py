"""Activation estimates against the bytes autograd really keeps (saved_tensors_hooks) in HF models on CPU."""

import pytest

torch = pytest.importorskip("torch")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from toolkit.estimate.measure import saved_activation_bytes  # noqa: E402
from toolkit.estimate.memory import estimate_memory  # noqa: E402
from toolkit.spec.model import spec_from_hf_dict  # noqa: E402
from toolkit.spec.plan import resolve_plan  # noqa: E402

SHAPES = [  # (batch, seq, hidden, heads, kv heads, ffn, vocab)
    (2, 64, 128, 8, 2, 352, 1000),
    (1, 256, 256, 4, 4, 512, 3000),
    (4, 96, 192, 6, 3, 512, 2048),
]


def _config(family, hidden, heads, kv, ffn, vocab):
    if family == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=hidden, n_layer=2, n_head=heads, vocab_size=vocab, n_positions=512,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoConfig.for_model(family, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                                num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab, pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"b{s[0]}s{s[1]}h{s[2]}")
@pytest.mark.parametrize("attention, precision", [("sdpa", "bf16"), ("eager", "bf16"), ("sdpa", "fp32")])
def test_activation_estimate_within_10_percent_of_saved_tensors(family, shape, attention, precision):
    batch, seq, hidden, heads, kv, ffn, vocab = shape
    config = _config(family, hidden, heads, kv, ffn, vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model = model.to(torch.bfloat16 if precision == "bf16" else torch.float32).train()
    ids = torch.randint(0, vocab, (batch, seq))
    measured = saved_activation_bytes(model, input_ids=ids, labels=ids)

    spec = spec_from_hf_dict(config.to_dict(), family, filled=True)
    plan = resolve_plan(spec, 1, zero=0, micro_batch=batch, seq_len=seq, precision=precision, attention=attention)
    estimated = estimate_memory(spec, plan).activations
    assert estimated == pytest.approx(measured, rel=0.10), f"estimated {estimated}, measured {measured}"


def test_eager_attention_costs_the_s_squared_term_and_sdpa_does_not():
    config = _config("llama", 128, 8, 2, 352, 1000)
    spec = spec_from_hf_dict(config.to_dict(), "llama", filled=True)
    short = {a: estimate_memory(spec, resolve_plan(spec, 1, zero=0, seq_len=256, attention=a)).activations for a in ("sdpa", "eager")}
    long = {a: estimate_memory(spec, resolve_plan(spec, 1, zero=0, seq_len=1024, attention=a)).activations for a in ("sdpa", "eager")}
    assert long["sdpa"] == pytest.approx(4 * short["sdpa"], rel=0.01)  # linear in s
    assert long["eager"] > 4.5 * short["eager"]  # super-linear: the s x s probabilities


def test_the_loss_peak_is_three_fp32_logits_as_the_estimate_counts():
    """HF's loss peaks in the log-softmax's backward with three fp32 logits alive (output, incoming and outgoing
    gradient): on an H200 it was Llama 3.2 1B's peak at 32K tokens, 20% above an estimate that counted two
    (benchmarks/gpu_check.md, benchmarks/loss_memory_cpu.md)."""
    from toolkit.estimate.measure import peak_live_bytes
    from toolkit.estimate.memory import loss_peak_bytes

    config = _config("llama", 64, 4, 2, 256, 32000)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 32000, (1, 512))
    peak, at = peak_live_bytes(lambda: model(input_ids=ids, labels=ids).loss.backward())
    assert at.startswith("_log_softmax_backward_data")
    spec = spec_from_hf_dict(config.to_dict(), "llama", filled=True)
    plan = resolve_plan(spec, 1, zero=0, seq_len=512, recompute="full")
    memory, head = estimate_memory(spec, plan), loss_peak_bytes(spec, plan)
    assert head == pytest.approx(peak, rel=0.03), f"estimated {head}, measured {peak}"
    logits = 4 * 32000 * 512
    assert head > memory.activations + 1.9 * logits  # two beside the one the activations keep
    assert "head_backward" in memory.overhead_detail  # the loss's peak sets the estimate's total here


MOE_CONFIGS = {  # tiny configs of every HF MoE family, all layers MoE (DeepSeek-V3 with its shared expert)
    "qwen3_moe": dict(num_key_value_heads=2, head_dim=32, intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=96),
    "mixtral": dict(num_key_value_heads=2, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(num_key_value_heads=4, intermediate_size=256, q_lora_rank=None, kv_lora_rank=32,
                        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=96, n_shared_experts=1, n_group=1, topk_group=1,
                        first_k_dense_replace=0),
    "gpt_oss": dict(num_key_value_heads=2, head_dim=32, intermediate_size=96, num_local_experts=4,
                    num_experts_per_tok=2, layer_types=["full_attention", "full_attention"]),
}


@pytest.mark.parametrize("family", sorted(MOE_CONFIGS))
def test_hf_moe_activation_estimate_within_10_percent_of_saved_tensors(family):
    """transformers' MoE blocks keep, per chosen expert, the token's copy, the expert MLP's tensors and the expert's
    output that the routing weight multiplies (for that weight's gradient), plus the router's fp32 scores and the
    shared experts' MLP. Eager attention: GPT-OSS has no sdpa path, MLA no fused CPU kernel."""
    config = AutoConfig.for_model(family, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
                                  pad_token_id=0, **MOE_CONFIGS[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(torch.bfloat16).train()
    ids = torch.randint(0, 1000, (2, 64))
    measured = saved_activation_bytes(model, input_ids=ids, labels=ids)
    spec = spec_from_hf_dict(config.to_dict(), family, filled=True)
    assert spec.is_moe and all(spec.is_moe_layer(i) for i in range(spec.num_layers))
    plan = resolve_plan(spec, 1, zero=0, micro_batch=2, seq_len=64, precision="bf16", attention="eager")
    estimated = estimate_memory(spec, plan).activations
    assert estimated == pytest.approx(measured, rel=0.10), f"estimated {estimated}, measured {measured}"
