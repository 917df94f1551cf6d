"""Constants shared by the Megatron-Core tests and their fixtures."""

import sys
from pathlib import Path

from helpers import ROOT, TRAIN  # noqa: F401  (the Megatron tests import it from here)

BIN = Path(sys.executable).parent
TINY_MEGATRON = ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml"
STEPS, SAVE_AT = 8, 4  # enough for the tiny corpus's loss to fall clearly; the resume tests restart at SAVE_AT
RESAVE_AT = SAVE_AT + 2  # the dp2 run resumed from its background save saves synchronously here (conftest.dp2_resumed)

# tiny HF configs of the MoE families (4 experts, top 2) for Megatron-Core training at EP 2 (conftest.moe_run)
_TINY_MOE_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False, hidden_act="silu",
                        bos_token_id=0, eos_token_id=0, num_experts_per_tok=2, router_aux_loss_coef=0.01)
TINY_MOE = {
    "qwen3_moe": dict(_TINY_MOE_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=4, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(_TINY_MOE_COMMON, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=32,
                    num_local_experts=4),
}
MOE_STEPS = 6
