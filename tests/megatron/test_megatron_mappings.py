"""The HF <-> Megatron-Core tables: the split/merge helpers round-trip, every preset of a mapped family reads the same
through the table as through the model spec, settings Megatron-Core cannot express are refused, and tiny HF models of
every family give Megatron-Core's logits once their checkpoint is loaded through the weight table."""

import json
from pathlib import Path

import pytest

from toolkit.errors import UserInputError
from toolkit.families import FAMILIES, MAPPED, megatron_fields, megatron_mapping
from toolkit.families.mapping import merge_gated, merge_qkv, split_gated, split_qkv
from toolkit.spec.model import PRESET_DIR, load_model_spec

SCRIPT = Path(__file__).resolve().parent / "mcore_vs_hf.py"
MAPPED_PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.json")
                        if json.loads(p.read_text())["model_type"] in MAPPED)


@pytest.mark.parametrize("heads, groups", [(8, 2), (4, 4), (6, 1)])
def test_qkv_merge_interleaves_per_query_group_and_splits_back(heads, groups):
    import torch

    head_dim, hidden = 3, 5
    q = torch.arange(heads * head_dim * hidden, dtype=torch.float).reshape(heads * head_dim, hidden)
    k = -torch.arange(groups * head_dim * hidden, dtype=torch.float).reshape(groups * head_dim, hidden) - 1
    v = k - 1000
    merged = merge_qkv(q, k, v, heads, groups, head_dim)
    per_group = heads // groups  # group g: its heads' queries, then its key head, then its value head
    expected = torch.cat([torch.cat([q[g * per_group * head_dim:(g + 1) * per_group * head_dim],
                                     k[g * head_dim:(g + 1) * head_dim], v[g * head_dim:(g + 1) * head_dim]])
                          for g in range(groups)])
    assert torch.equal(merged, expected)
    for got, want in zip(split_qkv(merged, heads, groups, head_dim), (q, k, v)):
        assert torch.equal(got, want)
    bias = merge_qkv(q[:, 0], k[:, 0], v[:, 0], heads, groups, head_dim)  # biases take the same path
    assert torch.equal(bias, merged[:, 0])


def test_gated_mlp_merge_is_gate_then_up_and_splits_back():
    import torch

    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    merged = merge_gated(gate, up)
    assert torch.equal(merged[:6], gate)
    assert all(torch.equal(a, b) for a, b in zip(split_gated(merged), (gate, up)))


@pytest.mark.parametrize("preset", MAPPED_PRESETS)
def test_every_mapped_preset_reads_the_same_through_the_table_and_the_model_spec(preset):
    hf = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    spec, sections = load_model_spec(preset), megatron_fields(hf)
    tc, gpt = sections["transformer_config"], sections["gpt_model"]
    assert (tc["num_layers"], tc["hidden_size"], tc["num_attention_heads"], tc["num_query_groups"]) == \
           (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads)
    if spec.mla:  # query/key heads of nope + rope, value heads of their own, the norms on the latents
        assert (tc["qk_head_dim"] + tc["qk_pos_emb_head_dim"], tc["qk_pos_emb_head_dim"], tc["v_head_dim"]) == \
               (spec.head_dim, spec.qk_rope_head_dim, spec.value_head_dim)
        assert (tc["q_lora_rank"], tc["kv_lora_rank"]) == (spec.q_lora_rank, spec.kv_lora_rank)
        assert tc["multi_latent_attention"] and tc["qk_layernorm"] and not spec.qk_norm
    else:
        assert (tc.get("kv_channels") or spec.hidden_size // spec.num_attention_heads) == spec.head_dim
        assert tc["qk_layernorm"] == spec.qk_norm
    assert sections["model"]["vocab_size"] == spec.vocab_size
    assert gpt["share_embeddings_and_output_weights"] == spec.tie_embeddings
    assert tc["gated_linear_unit"] == spec.gated_mlp
    assert tc["normalization"] == {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[spec.norm]
    yarn = gpt["position_embedding_type"] == "yarn"  # GPTModel's YaRN: gpt_oss (deepseek_v3's is MLA's rope_type)
    assert ("yarn" if yarn else gpt["position_embedding_type"]) == \
           {"rope": "yarn" if spec.rope_attention_factor != 1 else "rope",
            "learned": "learned_absolute"}[spec.position_embedding]
    assert (tc["add_qkv_bias"] or tc["add_bias_linear"]) == spec.qkv_bias
    assert tc["add_bias_linear"] == (spec.mlp_bias or spec.expert_bias) == spec.attn_out_bias
    assert (tc.get("softmax_type", "vanilla") == "learnable") == spec.attention_sinks
    assert tc.get("activation_func_clamp_value") == spec.activation_clamp
    if spec.family == "gpt_oss":  # Megatron-Core's window counts the keys before the query, transformers' the query too
        assert tc["window_size"] == [spec.sliding_window - 1, 0]
        assert tuple(i for i, sliding in enumerate(tc["window_attn_skip_freq"]) if sliding) == spec.sliding_layers
    if spec.is_moe:
        assert (tc["num_moe_experts"], tc["moe_router_topk"], tc["moe_ffn_hidden_size"]) == \
               (spec.num_experts, spec.experts_top_k, spec.moe_ffn_hidden_size)
        if isinstance(tc.get("moe_layer_freq"), list):  # dense layers first (first_k_dense_replace)
            assert tuple(i for i, moe in enumerate(tc["moe_layer_freq"]) if moe) == spec.moe_layers
        assert (tc.get("moe_shared_expert_intermediate_size") or 0) == spec.shared_expert_ffn_hidden_size
        assert (tc.get("moe_router_score_function", "softmax"), tc.get("moe_router_enable_expert_bias", False)) == \
               (spec.moe_router_score, spec.moe_router_expert_bias)
    else:
        assert tc["ffn_hidden_size"] == spec.ffn_hidden_size and "num_moe_experts" not in tc


@pytest.mark.parametrize("preset", MAPPED_PRESETS)
def test_the_config_table_reads_both_ways(preset):
    hf = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    sections = megatron_fields(hf)
    back = megatron_mapping(hf["model_type"]).hf_fields(hf["model_type"], sections)
    assert back["architectures"] == hf["architectures"]
    assert megatron_fields({**hf, **back}) == sections
    assert {k: v for k, v in back.items() if k in hf and k != "architectures"} == \
           {k: (float(hf[k]) if isinstance(back[k], float) else hf[k]) for k in back if k in hf and k != "architectures"}


@pytest.mark.parametrize("change, key, says", [
    (dict(model_type="gemma2"), "model.source", "no Megatron-Core mapping for model family 'gemma2'"),
    (dict(attention_bias=True), "model.config.attention_bias", "only biases together with the MLP"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "model.config.rope_scaling", "rope_type 'yarn'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 4096}),
     "model.config.rope_scaling", "original_max_position_embeddings=4096"),
    (dict(hidden_act="tanh"), "model.config.hidden_act", "activation 'tanh' has no Megatron-Core equivalent"),
])
def test_settings_megatron_core_cannot_express_are_refused(change, key, says):
    hf = {**json.loads((PRESET_DIR / "llama-3.1-8b.json").read_text()), **change}
    with pytest.raises(UserInputError) as err:
        megatron_fields(hf)
    assert err.value.key == key and says in err.value.message


DEEPSEEK = json.loads((PRESET_DIR / "deepseek-v3.json").read_text())


def test_deepseek_v3_and_kimi_k2_map_their_yarn_rope_and_group_limited_routing():
    tc = megatron_fields(DEEPSEEK)["transformer_config"]
    assert (tc["rope_type"], tc["rotary_scaling_factor"], tc["original_max_position_embeddings"], tc["mscale"],
            tc["mscale_all_dim"], tc["rotary_base"]) == ("yarn", 40.0, 4096, 1.0, 1.0, 10000)
    assert (tc["moe_router_num_groups"], tc["moe_router_group_topk"], tc["moe_router_topk_scaling_factor"]) == \
           (8, 4, 2.5)
    assert tc["moe_layer_freq"] == [0, 0, 0] + [1] * 58 and "mtp_num_layers" not in tc  # transformers builds no MTP
    kimi = megatron_fields(json.loads((PRESET_DIR / "kimi-k2.json").read_text()))["transformer_config"]
    assert (kimi["num_moe_experts"], kimi["moe_router_num_groups"], kimi["moe_router_group_topk"]) == (384, None, None)
    plain = megatron_fields({**DEEPSEEK, "rope_scaling": None})["transformer_config"]
    assert (plain["rope_type"], plain["mscale_all_dim"]) == ("rope", 0.0)  # MLA's softmax scale left unscaled


@pytest.mark.parametrize("change, key, says", [
    (dict(attention_bias=True), "attention_bias", "MLA projections have no biases"),
    (dict(rope_interleave=False), "rope_interleave", "interleaved pairs"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps", "q_a/kv_a norms"),
    (dict(norm_topk_prob=False), "norm_topk_prob", "renormalises the top k"),
    (dict(topk_group=2), "topk_group", "only topk / topk_group = 2"),
    (dict(moe_layer_freq=2), "moe_layer_freq", "first_k_dense_replace"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling", "rope_type 'linear'"),
    (dict(rope_scaling={**DEEPSEEK["rope_scaling"], "attention_factor": 0.5}), "rope_scaling", "attention_factor"),
    (dict(rope_scaling=None, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters", "no factor or original_max_position_embeddings"),
])
def test_deepseek_v3_settings_megatron_core_cannot_express_are_refused(change, key, says):
    with pytest.raises(UserInputError) as err:
        megatron_fields({**DEEPSEEK, **change})
    assert err.value.key == f"model.config.{key}" and says in err.value.message and "\n" not in str(err.value)


GPT_OSS = json.loads((PRESET_DIR / "gpt-oss-120b.json").read_text())


def test_gpt_oss_maps_sinks_windows_clamped_swiglu_biased_experts_and_yarn():
    tc, gpt = (megatron_fields(GPT_OSS)[k] for k in ("transformer_config", "gpt_model"))
    assert (tc["softmax_type"], tc["window_size"], tc["window_attn_skip_freq"]) == ("learnable", [127, 0], [1, 0] * 18)
    assert (tc["activation_func"], tc["glu_linear_offset"], tc["activation_func_clamp_value"]) == \
           ("quick_gelu", 1.0, 7.0)
    assert tc["add_bias_linear"] and tc["add_qkv_bias"] and (tc["num_moe_experts"], tc["moe_router_topk"]) == (128, 4)
    assert (gpt["position_embedding_type"], tc["yarn_rotary_scaling_factor"], tc["yarn_original_max_position_embeddings"],
            tc["yarn_correction_range_round_to_int"], gpt["rotary_base"]) == ("yarn", 32.0, 4096, False, 150000)
    assert tc["yarn_mscale"] is None and tc["yarn_mscale_all_dim"] is None  # 0.1 ln(32) + 1, as transformers' default


@pytest.mark.parametrize("change, key, says", [
    (dict(attention_bias=False), "attention_bias", "without attention biases"),
    (dict(swiglu_alpha=1.5), "swiglu_alpha", "fixes alpha at 1.702"),
    (dict(rope_scaling={**GPT_OSS["rope_scaling"], "attention_factor": 1.2}), "rope_scaling", "attention_factor"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling", "rope_type 'linear'"),
])
def test_gpt_oss_settings_megatron_core_cannot_express_are_refused(change, key, says):
    with pytest.raises(UserInputError) as err:
        megatron_fields({**GPT_OSS, **change})
    assert err.value.key == f"model.config.{key}" and says in err.value.message and "\n" not in str(err.value)


def test_hf_to_megatron_refuses_gpt_oss_expert_tensor_parallelism_in_one_line(tmp_path, capsys):
    """Megatron-Core 0.16.1 builds biased experts at ETP 1 only (TransformerConfig.__post_init__): --tp 2 alone
    would write a checkpoint no TP 2 run could build; refused before anything is read or written."""
    from toolkit.cli.main import main

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({k: v for k, v in GPT_OSS.items() if k != "quantization_config"}))
    capsys.readouterr()
    assert main(["convert", "hf-to-megatron", str(hf), str(tmp_path / "out"), "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--etp" in err[0] and "expert tensor-parallel size 1" in err[0], err
    assert not (tmp_path / "out").exists()


def test_every_family_declares_its_weights():
    for family in MAPPED:
        assert FAMILIES[family].model_type == family and megatron_mapping(family).weights, family


@pytest.mark.launch
def test_hf_checkpoints_give_megatron_core_the_same_logits_through_the_tables(torchrun):
    """llama (also llama3 rope scaling and tied embeddings), mistral, qwen2 (q/k/v biases), qwen3 (q/k norms),
    mixtral and qwen3_moe (MoE router and experts), deepseek_v3 (multi-latent attention with YaRN or plain rope, a
    dense first layer, shared experts, the sigmoid router's expert bias, group-limited routing), gpt_oss (sinks,
    alternating sliding windows shorter than the batch's rows, YaRN, biased and clamped experts stacked with gate and
    up interleaved) and gpt2 (Conv1D, fused c_attn, learned positions, LayerNorm, biases)."""
    run = torchrun("mcore-vs-hf", script=SCRIPT, nproc=1)
    path = run.out / "logits.json"
    assert path.is_file(), run.tail()
    results = json.loads(path.read_text())
    assert set(results) == {"llama", "llama3-rope-scaling", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe",
                            "deepseek_v3", "deepseek_v3-q-direct", "gpt_oss", "gpt2"}
    for family, result in results.items():
        assert result["scale"] > 0.1, family  # real logits
        assert result["max_abs_diff"] < 1e-5, (family, result)  # a wrong mapping is off by ~1e-2 here
    # the same launch builds Megatron-Core's model with a dense first layer, shared experts and two MTP modules:
    # the toolkit counts each part as Megatron-Core builds it (MTP apart, as transformers builds none)
    mtp = json.loads((run.out / "mtp_params.json").read_text())
    assert mtp["shared_experts"] > 0 and mtp["megatron_mtp"] > 0
    assert (mtp["toolkit_total"], mtp["toolkit_mtp"]) == (mtp["megatron_total"], mtp["megatron_mtp"])
