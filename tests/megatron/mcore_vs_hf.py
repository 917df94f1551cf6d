"""Launched by test_megatron_mappings.py under torchrun (1 CPU rank): for each mapped family, a tiny HF model with
random weights saved as an HF checkpoint, and the Megatron-Core GPTModel built from the family's config table and
loaded from that checkpoint through the family's weight table; writes how far their logits of one batch differ."""

import argparse
import json
from pathlib import Path

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5,
             rope_theta=10000.0)
FAMILIES = {
    "llama": dict(SMALL, model_type="llama"),
    "llama3-rope-scaling": dict(SMALL, model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "mistral": dict(SMALL, model_type="mistral", sliding_window=8),  # shorter than the rows: the window shows
    "qwen2": dict(SMALL, model_type="qwen2"),
    "qwen3": dict(SMALL, model_type="qwen3", head_dim=32),
    "mixtral": dict(SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(SMALL, model_type="qwen3_moe", head_dim=16, moe_intermediate_size=48, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # multi-latent attention with YaRN, a dense first layer, then routed and shared experts chosen within 1 of 2
    # groups; transformers' latent norms keep eps 1e-6 and its MLA keys/values are per head
    "deepseek_v3": dict(SMALL, model_type="deepseek_v3", num_key_value_heads=4, rms_norm_eps=1e-6, q_lora_rank=24,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=2, topk_group=1, rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32,
                                                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                               "original_max_position_embeddings": 32}),
    "deepseek_v3-q-direct": dict(SMALL, model_type="deepseek_v3", num_key_value_heads=4, rms_norm_eps=1e-6,
                                 q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                 v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                 n_shared_experts=2, first_k_dense_replace=0, n_group=1, topk_group=1),
    # attention sinks, sliding windows of 8 tokens on the first layer (32 tokens a row), q/k/v/o biases, YaRN, the
    # router's bias and biased experts stacked per layer with gate and up interleaved, the clamped SwiGLU
    "gpt_oss": dict(SMALL, model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                                                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                       "original_max_position_embeddings": 16}),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128,
                 resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0),
}


def tiny_model(hf_config: dict):
    """A random HF model of a FAMILIES config; DeepSeek-V3's router bias (a buffer transformers starts at zeros) and
    GPT-OSS's biases (parameters it starts at zeros) random too, so that a mapping that lost one would show."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config), attn_implementation="eager")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.1)
        for name, param in model.named_parameters():
            if hf_config["model_type"] == "gpt_oss" and name.endswith("bias"):
                param.copy_(torch.randn(param.shape) * 0.1)
    return model.eval()


def megatron_logits(hf_config: dict, hf_state: dict, tokens):
    """Logits of Megatron-Core's GPTModel (TP=1, local spec) holding the HF weights, mapped by the tables."""
    import torch

    from toolkit.backends.megatron.build import build_model_chunks, initialize_parallel, transformer_config
    from toolkit.families import megatron_fields, megatron_mapping

    sections = megatron_fields(hf_config)
    config = {
        "schedule": {"seed": 0},
        "transformer_config": {**sections["transformer_config"], "tensor_model_parallel_size": 1,
                               "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                               "expert_model_parallel_size": 1, "use_cpu_initialization": True,
                               "transformer_impl": "local"},
        "gpt_model": {**sections["gpt_model"], "vocab_size": sections["model"]["vocab_size"]},
    }
    initialize_parallel(config)
    model = build_model_chunks(config, transformer_config(config))[0].eval()
    state = megatron_mapping(hf_config["model_type"]).to_megatron_state_dict(hf_config, hf_state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from toolkit.backends.megatron.build import destroy, init_distributed
    from toolkit.compat.megatron_cpu import cuda_on_cpu

    init_distributed()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    with cuda_on_cpu():
        for name, hf_config in FAMILIES.items():
            torch.manual_seed(0)
            hf_model = tiny_model(hf_config)
            tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                expected = hf_model(tokens).logits
            hf_model.save_pretrained(args.output_dir / name)  # the checkpoint layout a converter reads
            got = megatron_logits(hf_config, load_file(args.output_dir / name / "model.safetensors"), tokens)
            results[name] = {"max_abs_diff": float((got - expected).abs().max()), "scale": float(expected.abs().max())}
            destroy()
    (args.output_dir / "logits.json").write_text(json.dumps(results, indent=2))
    with cuda_on_cpu():
        counts = megatron_mtp_counts()
        destroy()
    (args.output_dir / "mtp_params.json").write_text(json.dumps(counts, indent=2))
    dist.destroy_process_group()


def megatron_mtp_counts() -> dict:
    """Parameters of Megatron-Core's GPTModel (local spec) with a dense first layer, routed and shared experts and
    two multi-token prediction modules, beside the toolkit's count of the same ModelSpec: the decoder and head apart
    from the `mtp.` modules, which transformers never builds and the toolkit counts apart (ParamCounts.mtp)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.compat.megatron_seams import moe_without_transformer_engine
    from toolkit.estimate.params import count_params
    from toolkit.spec.model import ModelSpec

    spec = ModelSpec(num_layers=3, hidden_size=32, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                     ffn_hidden_size=40, vocab_size=96, num_experts=4, experts_top_k=2, moe_ffn_hidden_size=16,
                     moe_layers=(1, 2), shared_expert_ffn_hidden_size=24, mtp_layers=2)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    moe_without_transformer_engine()
    tc = TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=40,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=24,
        moe_layer_freq=[0, 1, 1], mtp_num_layers=2, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, use_cpu_initialization=True,
        transformer_impl="local", moe_token_dispatcher_type="allgather")
    block = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(config=tc, transformer_layer_spec=block, vocab_size=96, max_sequence_length=128,
                     position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(tc, block.layer_specs[-1], use_transformer_engine=False))
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    mtp = sum(n for name, n in sizes.items() if name.startswith("mtp."))
    counts = count_params(spec)
    return {"megatron_total": sum(sizes.values()) - mtp, "megatron_mtp": mtp, "toolkit_total": counts.total,
            "toolkit_mtp": counts.mtp, "shared_experts": sum(n for name, n in sizes.items() if "shared_experts" in name)}


if __name__ == "__main__":
    main()
