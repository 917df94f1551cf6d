"""The HF <-> Megatron-Core weight mapping types own their merge and split: each round-trips on small tensors, a
mapping of a type the engine does not know is refused, and a whole tiny model's state dict goes through a family's
table and back; the one activation table feeds the generator's functions and the validator's names."""

import pytest

torch = pytest.importorskip("torch")

from toolkit.families import megatron_mapping  # noqa: E402
from toolkit.families.activations import HF_ACTIVATIONS, MEGATRON_ACTIVATIONS, hf_activation  # noqa: E402
from toolkit.families.mapping import (  # noqa: E402
    QKV,
    FusedQKV,
    GatedMLP,
    MegatronMapping,
    Rename,
    WeightGeometry,
    WeightMapping,
)

HEADS, GROUPS, HEAD_DIM, HIDDEN, VOCAB = 4, 2, 3, 5, 7
GEOMETRY = WeightGeometry(HEADS, GROUPS, HEAD_DIM, VOCAB, tied=False)
Q, KV = HEADS * HEAD_DIM, GROUPS * HEAD_DIM


def _random(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


CASES = {
    "rename": (Rename("a.weight", "x.weight"), {"a.weight": _random(6, HIDDEN)}),
    "rename-conv1d": (Rename("a.weight", "x.weight", transpose=True), {"a.weight": _random(HIDDEN, 6)}),
    "qkv-weights": (QKV("q", "k", "v", "qkv"), {"q": _random(Q, HIDDEN), "k": _random(KV, HIDDEN),
                                                "v": _random(KV, HIDDEN) + 10}),
    "qkv-biases": (QKV("q", "k", "v", "qkv"), {"q": _random(Q), "k": _random(KV), "v": _random(KV) + 10}),
    "fused-qkv-conv1d": (FusedQKV("c_attn.weight", "qkv", transpose=True),
                         {"c_attn.weight": _random(HIDDEN, Q + 2 * KV)}),
    "fused-qkv-bias": (FusedQKV("c_attn.bias", "qkv"), {"c_attn.bias": _random(Q + 2 * KV)}),
    "gated-mlp": (GatedMLP("gate", "up", "fc1"), {"gate": _random(6, HIDDEN), "up": _random(6, HIDDEN) + 10}),
}


@pytest.mark.parametrize("case", CASES)
def test_every_mapping_type_round_trips(case):
    item, hf = CASES[case]
    merged = item.to_megatron(hf.__getitem__, GEOMETRY)
    assert merged.shape[0] == sum(t.shape[-1] if getattr(item, "transpose", False) else t.shape[0] for t in hf.values())
    back = item.to_hf(merged, GEOMETRY)
    assert list(back) == list(item.hf_names()) == list(hf)
    assert all(torch.equal(back[name], hf[name]) and back[name].is_contiguous() for name in hf)


def test_fused_qkv_is_interleaved_like_separate_projections():
    q, k, v = _random(Q, HIDDEN), _random(KV, HIDDEN), _random(KV, HIDDEN)
    separate = QKV("q", "k", "v", "qkv").to_megatron({"q": q, "k": k, "v": v}.__getitem__, GEOMETRY)
    fused = FusedQKV("c", "qkv", transpose=True).to_megatron({"c": torch.cat([q, k, v]).t()}.__getitem__, GEOMETRY)
    assert torch.equal(separate, fused)
    assert torch.equal(separate[: Q // GROUPS], q[: Q // GROUPS])  # group 0: its query heads, then its k and v
    assert torch.equal(separate[Q // GROUPS: Q // GROUPS + HEAD_DIM], k[:HEAD_DIM])


def test_vocabulary_padding_is_cut_off_on_the_way_back():
    embedding = _random(VOCAB, HIDDEN)
    padded = torch.cat([embedding, torch.zeros(128 - VOCAB, HIDDEN)])
    back = Rename("embed", "embedding.word_embeddings.weight").to_hf(padded, GEOMETRY)
    assert torch.equal(back["embed"], embedding)


def test_names_expand_per_layer_and_expert():
    item = GatedMLP("l{layer}.e{expert}.w1", "l{layer}.e{expert}.w3", "d{layer}.x{expert}.fc1").expand(2, 5)
    assert item == GatedMLP("l2.e5.w1", "l2.e5.w3", "d2.x5.fc1")


def test_a_mapping_of_an_unknown_type_is_refused():
    class Half(WeightMapping):  # says how to read, not how to split back
        def hf_names(self):
            return ("a",)

        def to_megatron(self, read, geometry):
            return read("a")

    with pytest.raises(TypeError, match="abstract"):
        Half()
    with pytest.raises(TypeError, match="is not a WeightMapping"):
        MegatronMapping("LlamaForCausalLM", (), weights=(Rename("a", "b"), ("q", "k", "v", "qkv")))


def _tiny_llama_state(config: dict) -> dict:
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
             "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
             "mlp.down_proj.weight": (h, f)}
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    shapes |= {f"model.layers.{i}.{name}": shape for i in range(config["num_hidden_layers"])
               for name, shape in layer.items()}
    return {name: _random(*shape) + i for i, (name, shape) in enumerate(shapes.items())}


@pytest.mark.parametrize("tied", [False, True])
def test_a_tiny_llama_state_dict_goes_through_the_table_and_back(tied):
    config = dict(model_type="llama", hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=11, max_position_embeddings=32, tie_word_embeddings=tied)
    hf = _tiny_llama_state(config)
    if tied:
        del hf["lm_head.weight"]
    mapping = megatron_mapping("llama")
    megatron = mapping.to_megatron_state_dict(config, hf)
    assert len(megatron) == 2 + (not tied) + 2 * 6
    assert megatron["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (16 + 2 * 8, 16)
    assert ("output_layer.weight" in megatron) is not tied
    back = mapping.to_hf_state_dict(config, megatron)
    assert set(back) == set(hf) and all(torch.equal(back[name], hf[name]) for name in hf)


def test_one_activation_table_feeds_the_generator_and_the_validator():
    pytest.importorskip("megatron.core")
    from toolkit.families.activations import megatron_function
    from toolkit.validate.megatron import MEGATRON_ACTIVATIONS as accepted

    assert accepted is MEGATRON_ACTIVATIONS
    assert {a.megatron for a in HF_ACTIVATIONS.values() if a.megatron} <= set(MEGATRON_ACTIVATIONS)
    x = torch.linspace(-2, 2, 9)
    for name in MEGATRON_ACTIVATIONS:
        assert megatron_function(name)(x).shape == x.shape, name
    assert [hf_activation(name) for name in ("silu", "gelu", "openai_gelu", "relu")] == \
           ["silu", "gelu", "gelu_new", "relu"]
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        megatron_function("tanh")


def test_a_deepseek_v3_table_maps_dense_layers_dense_and_moe_layers_with_router_bias_and_shared_experts():
    """first_k_dense_replace: layer 0 has Megatron-Core's dense linear_fc1/fc2, layer 1 the router (with the
    e_score_correction_bias as its expert_bias), the experts and the shared experts; queries through q_a/q_b."""
    config = dict(model_type="deepseek_v3", hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                  num_hidden_layers=2, num_attention_heads=2, vocab_size=11, max_position_embeddings=32,
                  q_lora_rank=6, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3,
                  n_routed_experts=2, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                  topk_group=1)
    items, _ = megatron_mapping("deepseek_v3").weight_table(config)
    by_layer = {layer: {i.megatron.split(f"layers.{layer}.")[1] for i in items if f"layers.{layer}." in i.megatron}
                for layer in (0, 1)}
    assert {"mlp.linear_fc1.weight", "mlp.linear_fc2.weight"} <= by_layer[0]
    assert not any(name.startswith(("mlp.router", "mlp.experts", "mlp.shared")) for name in by_layer[0])
    assert {"mlp.router.weight", "mlp.router.expert_bias", "mlp.shared_experts.linear_fc1.weight",
            "mlp.experts.local_experts.1.linear_fc2.weight"} <= by_layer[1]
    assert "mlp.linear_fc1.weight" not in by_layer[1]
    assert by_layer[0] - {"mlp.linear_fc1.weight", "mlp.linear_fc2.weight"} == \
        by_layer[1] - {n for n in by_layer[1] if n.startswith("mlp.")}
    hf = {name: _random(3) + i for i, name in enumerate(n for item in items for n in item.hf_names())
          if not name.endswith("q_proj.weight")}  # q_lora_rank set: q_a/q_b, not q_proj
    megatron = megatron_mapping("deepseek_v3").to_megatron_state_dict(config, hf)
    assert torch.equal(megatron["decoder.layers.1.mlp.router.expert_bias"],
                       hf["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" not in megatron
    back = megatron_mapping("deepseek_v3").to_hf_state_dict(config, megatron)
    assert set(back) == set(hf) and all(torch.equal(back[name], hf[name]) for name in hf)


def test_a_gpt_oss_table_splits_the_interleaved_experts_into_gate_then_up_and_computes_the_same():
    """GPT-OSS stacks every expert of a layer in one tensor ([E, H, 2F] with gate and up alternating on the last axis,
    x @ W); expert e's linear_fc1 is [gate; up] as [2F, H] and its bias likewise: Megatron-Core's clamped GLU
    (quick_gelu(clamp(gate)) * (clamp(up) + 1)) on the mapped weights gives transformers' expert output, and the
    table maps the whole model back bit for bit, sinks, router bias and q/k/v/o biases included."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(model_type="gpt_oss", hidden_size=16, intermediate_size=12, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=3, num_experts_per_tok=2,
                  vocab_size=11, max_position_embeddings=64, sliding_window=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 1.0)  # biases too (transformers starts them at zeros)
    hf = {name: t.detach().clone() for name, t in model.state_dict().items()}
    table = megatron_mapping("gpt_oss")
    megatron = table.to_megatron_state_dict(config, hf)
    experts = model.model.layers[1].mlp.experts
    x = _random(5, 16)
    with torch.no_grad():
        gate_up = x @ experts.gate_up_proj[2] + experts.gate_up_proj_bias[2]
        expected = experts._apply_gate(gate_up) @ experts.down_proj[2] + experts.down_proj_bias[2]
    prefix = "decoder.layers.1.mlp.experts.local_experts.2."
    gate, up = (x @ megatron[prefix + "linear_fc1.weight"].t() + megatron[prefix + "linear_fc1.bias"]).chunk(2, -1)
    got = quick_gelu(gate.clamp(max=7.0)) * (up.clamp(-7.0, 7.0) + 1.0)
    got = got @ megatron[prefix + "linear_fc2.weight"].t() + megatron[prefix + "linear_fc2.bias"]
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5) and expected.abs().max() > 1
    assert torch.equal(megatron["decoder.layers.0.self_attention.core_attention.softmax_offset"],
                       hf["model.layers.0.self_attn.sinks"])
    assert torch.equal(megatron["decoder.layers.1.mlp.router.bias"], hf["model.layers.1.mlp.router.bias"])
    back = table.to_hf_state_dict(config, megatron)
    assert set(back) == set(hf) and all(torch.equal(back[name], hf[name]) for name in hf)
