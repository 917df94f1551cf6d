"""Megatron-Core 0.16.1's multi-latent attention (DeepSeek-V3's) built by toolkit.backends.megatron.build with the
local spec on a CPU rank, no Transformer Engine: a tiny DeepSeek-V3-shaped model (query/key heads of 16 + 16, value
heads of 24, a dense first layer then an MoE layer with a shared expert and the sigmoid router's expert bias) trains
in-process on a gloo group of one. What makes it build: MLA's false HAVE_TE without TE and the local core attention
taking MLA's k/v channels (toolkit.compat.megatron_seams)."""

import torch


def test_a_tiny_mla_model_with_a_dense_first_layer_and_a_shared_expert_trains_with_the_local_spec(gloo_group_of_one):
    from megatron.core import parallel_state

    from toolkit.backends.megatron.build import build_model_chunks, device_context, initialize_parallel
    from toolkit.backends.megatron.build import transformer_config as build_config

    config = {
        "transformer_config": dict(
            num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, normalization="RMSNorm",
            multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16,
            v_head_dim=24, kv_channels=24, rope_type="rope", qk_layernorm=True, add_bias_linear=False,
            gated_linear_unit=True, activation_func="silu", bias_activation_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            use_cpu_initialization=True, transformer_impl="local", tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1, context_parallel_size=1, expert_model_parallel_size=1,
            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
            moe_layer_freq=[0, 1], moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_load_balancing_type="none", moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall"),
        "gpt_model": dict(vocab_size=512, max_sequence_length=64, position_embedding_type="rope"),
        "schedule": {"seed": 7},
    }
    with device_context():
        initialize_parallel(config)
        try:
            tc = build_config(config)
            (model,) = build_model_chunks(config, tc)
            names = {name for name, _ in model.named_parameters()}
            assert {"decoder.layers.0.self_attention.linear_kv_down_proj.weight",
                    "decoder.layers.0.self_attention.kv_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                    "decoder.layers.1.mlp.router.weight", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
                    "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"} <= names
            assert model.decoder.layers[1].mlp.router.expert_bias.shape == (4,)
            assert model.decoder.layers[0].self_attention.linear_proj.weight.shape == (64, 4 * 24)
            tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
            positions = torch.arange(32).expand(2, 32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            losses = []
            for _ in range(5):
                loss = model(tokens, positions, None, labels=tokens).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            assert losses[-1] < losses[0] - 0.5, losses  # the same batch again: it learns it
        finally:
            parallel_state.destroy_model_parallel()
