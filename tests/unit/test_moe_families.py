"""The MoE families' spec as a user meets it: Kimi K2 read as deepseek_v3, what the readers refuse, the MTP modules
counted where Megatron-Core trains them and said where transformers drops them, GPT-OSS's sliding layers."""

import json

import pytest

from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.estimate.memory import stage_params
from toolkit.estimate.params import count_params
from toolkit.spec.model import PRESET_DIR, load_model_spec, spec_from_hf_dict
from toolkit.spec.plan import resolve_plan

DEEPSEEK = json.loads((PRESET_DIR / "deepseek-v3.json").read_text())


def test_kimi_k2_reads_as_the_deepseek_v3_family():
    spec = load_model_spec("kimi-k2")
    assert spec.family == "deepseek_v3" and spec.mla and spec.num_experts == 384 and spec.moe_layers[0] == 1
    assert spec.moe_router_groups == spec.moe_router_group_topk == 1 and spec.mtp_layers == 0


def test_deepseek_v3_spec_carries_mla_shared_experts_routing_and_mtp():
    spec = load_model_spec("deepseek-v3")
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.head_dim, spec.qk_rope_head_dim, spec.value_head_dim) == \
        (1536, 512, 192, 64, 128)
    assert spec.shared_expert_ffn_hidden_size == 2048 and spec.num_moe_layers == 58 and spec.mtp_layers == 1
    assert spec.moe_router_score == "sigmoid" and spec.moe_router_expert_bias
    assert (spec.moe_router_groups, spec.moe_router_group_topk) == (8, 4)


def test_gpt_oss_alternates_sliding_and_full_layers():
    spec = load_model_spec("gpt-oss-120b")
    assert spec.sliding_layers == tuple(range(0, 36, 2)) and spec.sliding_window == 128
    assert [spec.attention_window(i) for i in range(3)] == [128, None, 128]
    assert spec.attention_sinks and spec.expert_bias and spec.router_bias and spec.vocab_size == 201088


@pytest.mark.parametrize("change, key", [
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(n_group=3), "spec"),  # 256 experts do not split into 3 groups
    (dict(kv_lora_rank=0), "kv_lora_rank"),
])
def test_bad_deepseek_configs_are_one_line_naming_the_key(change, key):
    with pytest.raises(UserInputError) as err:
        spec_from_hf_dict({**DEEPSEEK, **change}, "ds")
    assert err.value.key.endswith(key) and "\n" not in str(err.value)


def test_bad_gpt_oss_layer_types_name_the_key():
    data = json.loads((PRESET_DIR / "gpt-oss-20b.json").read_text())
    with pytest.raises(UserInputError) as err:
        spec_from_hf_dict({**data, "layer_types": ["full_attention"] * 3}, "oss")
    assert err.value.key.endswith("layer_types")


def test_mtp_modules_sit_on_megatrons_last_stage_and_nowhere_under_hf_trainer():
    spec = load_model_spec("deepseek-v3")
    counts = count_params(spec)
    one = counts.mtp_layers[0]
    assert counts.mtp == one.total + 2 * spec.hidden_size ** 2 + 3 * spec.hidden_size
    megatron = resolve_plan(spec, 64, backend="megatron", ep=64, seq_len=128)
    without = spec.model_copy(update={"mtp_layers": 0})
    extra = stage_params(spec, counts, megatron, 0).total - stage_params(without, count_params(without), megatron, 0).total
    assert extra == one.total - one.experts + one.experts // 64 + counts.mtp_eh_proj + counts.mtp_norms
    fsdp = resolve_plan(spec, 64, backend="fsdp", seq_len=128)
    assert stage_params(spec, counts, fsdp, 0) == stage_params(without, count_params(without), fsdp, 0)


@pytest.mark.parametrize("backend, said", [("megatron", "counted in memory and step time"), ("fsdp", "fsdp drops")])
def test_estimate_says_where_the_mtp_modules_count(capsys, backend, said):
    assert main(["estimate", "--model", "deepseek-v3", "--gpus", "256", "--backend", backend, "--seq-len", "1024"]) == 0
    summary = capsys.readouterr().out.splitlines()[0]
    assert "11.610B in multi-token prediction modules" in summary and said in summary


@pytest.mark.parametrize("q_lora_rank", [None, 96])
def test_mla_activations_within_10_percent_of_saved_tensors(q_lora_rank):
    """MLA's latents, their norms and its per-head q, k, v against what autograd keeps in transformers' DeepseekV3
    (dense layers only: the MoE terms are another test's). Eager attention: CPU's sdpa has no fused kernel for MLA's
    unequal qk and v head widths and falls back to an fp32 math path a GPU does not take."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.estimate.measure import saved_activation_bytes
    from toolkit.estimate.memory import estimate_memory

    config = AutoConfig.for_model(
        "deepseek_v3", hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=512, q_lora_rank=q_lora_rank, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=2,
        n_group=1, topk_group=1, vocab_size=1000, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(torch.bfloat16).train()
    ids = torch.randint(0, 1000, (2, 64))
    measured = saved_activation_bytes(model, input_ids=ids, labels=ids)
    spec = spec_from_hf_dict(config.to_dict(), "mla", filled=True)
    plan = resolve_plan(spec, 1, zero=0, micro_batch=2, seq_len=64, precision="bf16", attention="eager")
    assert estimate_memory(spec, plan).activations == pytest.approx(measured, rel=0.10)


def test_mla_latents_stay_whole_under_tensor_parallelism():
    """Megatron-Core duplicates MLA's down projections on every TP rank: the latents' bytes do not shrink with TP,
    the per-head part does."""
    from toolkit.estimate.activations import ActivationSetup, mla_compressed_bytes

    spec = load_model_spec("deepseek-v3")
    setups = [ActivationSetup(hf_modules=False, micro_batch=1, seq_len=4096, act_bytes=2, attention="sdpa",
                              recompute="none", tp=tp) for tp in (1, 8)]
    # TE's LayerNormColumnParallelLinear keeps its input and ln_out (bf16) and the fp32 rstd, for each latent
    assert mla_compressed_bytes(spec, 2, setups[0]) == mla_compressed_bytes(spec, 2, setups[1]) == \
        (2 * 2 * 512 + 4) + (2 * 2 * 1536 + 4)


def test_explain_counts_gpt_oss_windows_and_says_so(capsys):
    """GPT-OSS's sliding layers attend 128 tokens at any length: the attention FLOPs `--explain` counts are the full
    layers' over 8,192 tokens and the sliding layers' over their window, which the rule says."""
    from toolkit.estimate.flops import layer_forward_flops

    assert main(["estimate", "--model", "gpt-oss-20b", "--gpus", "8", "--seq-len", "8192", "--explain", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    entry = next(e for e in report["explain"] if e["component"] == "attention_flops")
    spec = load_model_spec("gpt-oss-20b")
    full, sliding = (layer_forward_flops(spec, i, 8192).attention for i in (1, 0))
    assert entry["flops_per_token"] == pytest.approx(3 * 12 * (full + sliding)) and sliding * 8192 == full * 128
    assert "12 of 24 layers attend at most 128 tokens" in entry["rule"]


def test_gpt_oss_clamped_swiglu_keeps_seven_ffn_wide_tensors():
    """GPT-OSS's expert activation (transformers' GptOssExperts._apply_gate) and down_proj's input, measured with
    saved_tensors_hooks on the module itself: what mlp_bytes_per_token counts for it under HF Trainer."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from toolkit.estimate.activations import ActivationSetup, mlp_bytes_per_token
    from toolkit.estimate.measure import saved_activation_bytes

    config = AutoConfig.for_model("gpt_oss", hidden_size=64, intermediate_size=48, num_local_experts=2,
                                  num_experts_per_tok=1)
    config._experts_implementation = "eager"
    experts = GptOssExperts(config).to(torch.bfloat16)
    tokens = 16
    hidden = torch.randn(tokens, 64, dtype=torch.bfloat16, requires_grad=True)
    routing = dict(router_indices=torch.zeros(tokens, 1, dtype=torch.long),
                   routing_weights=torch.ones(tokens, 1, dtype=torch.bfloat16))
    measured = saved_activation_bytes(experts, hidden_states=hidden, **routing)
    spec = load_model_spec("gpt-oss-20b").model_copy(update={"moe_ffn_hidden_size": 48})
    setup = ActivationSetup(hf_modules=True, micro_batch=1, seq_len=tokens, act_bytes=2, attention="eager",
                            recompute="none")
    # the MoE terms around it: the gathered input rows and the weighted output (hidden wide), the routing weight and
    # the two int64 indices of each token's row
    moe_terms = (2 * 2 * 64 + 2 + 2 * 8) * tokens
    assert measured - moe_terms == mlp_bytes_per_token(spec, 2, 48, setup) * tokens == 7 * 2 * 48 * tokens
