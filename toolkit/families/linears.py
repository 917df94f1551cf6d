"""The linear modules of each family that LoRA can adapt, as PEFT finds them by name, with their widths.

A name is the module's path below a decoder layer (`self_attn.q_proj`), or below the model for the few linear
modules outside the layers (OPT's `project_in` / `project_out`). Widths are sums of the spec's sizes: `hidden`,
`q` (heads x head_dim), `kv` (kv heads x head_dim), `ffn` (the dense MLP) and `embed` (OPT's word_embed_proj_dim).
Routed experts are 3-D parameters in transformers 5 (`MixtralExperts.gate_up_proj`), not linear modules; PEFT 0.21
adapts them through `target_parameters` when a target names an MLP projection or all-linear, which is not modelled:
the MoE families (`MOE`) offer their attention projections only. The output head is never a target (PEFT's `all-linear` leaves it out).
Checked against PEFT on random configs of every family (tests/unit/test_lora_params_vs_peft.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: str
    out_features: str
    # every layer, dense (non-MoE) layers only, once, or (MLA) with / without a q_lora_rank
    where: Literal["layer", "dense", "model", "q_lora", "q_direct"] = "layer"


def _llama_lineage() -> tuple[Linear, ...]:
    return (Linear("self_attn.q_proj", "hidden", "q"), Linear("self_attn.k_proj", "hidden", "kv"),
            Linear("self_attn.v_proj", "hidden", "kv"), Linear("self_attn.o_proj", "q", "hidden"),
            Linear("mlp.gate_proj", "hidden", "ffn", "dense"), Linear("mlp.up_proj", "hidden", "ffn", "dense"),
            Linear("mlp.down_proj", "ffn", "hidden", "dense"))


LLAMA = _llama_lineage()
MOE = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")
# transformers' DeepseekV3: multi-latent attention's projections (`q_lora`: the latent width, `kv_lora+rope`: the
# compressed kv and the shared rotary key, `kv_up`: heads x (qk_nope + v), `o_in`: heads x v). Its MLP names are left
# out as in the other MoE families: PEFT 0.21 maps gate_proj/up_proj/down_proj onto the routed experts' fused 3-D
# gate_up_proj too (it refuses gate_proj without up_proj for that reason), which is not modelled.
DEEPSEEK_V3 = (
    Linear("self_attn.q_proj", "hidden", "q", "q_direct"), Linear("self_attn.q_a_proj", "hidden", "q_lora", "q_lora"),
    Linear("self_attn.q_b_proj", "q_lora", "q", "q_lora"),
    Linear("self_attn.kv_a_proj_with_mqa", "hidden", "kv_lora+rope"), Linear("self_attn.kv_b_proj", "kv_lora", "kv_up"),
    Linear("self_attn.o_proj", "o_in", "hidden"),
)
LINEARS: dict[str, tuple[Linear, ...]] = {
    "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "gemma2": LLAMA,
    "mixtral": LLAMA[:4], "qwen3_moe": LLAMA[:4], "gpt_oss": LLAMA[:4],  # the attention projections
    "deepseek_v3": DEEPSEEK_V3,
    "phi3": (Linear("self_attn.qkv_proj", "hidden", "q+kv+kv"), Linear("self_attn.o_proj", "q", "hidden"),
             Linear("mlp.gate_up_proj", "hidden", "ffn+ffn"), Linear("mlp.down_proj", "ffn", "hidden")),
    "gpt2": (Linear("attn.c_attn", "hidden", "q+kv+kv"), Linear("attn.c_proj", "q", "hidden"),  # Conv1D modules
             Linear("mlp.c_fc", "hidden", "ffn"), Linear("mlp.c_proj", "ffn", "hidden")),
    "gpt_neox": (Linear("attention.query_key_value", "hidden", "q+kv+kv"), Linear("attention.dense", "q", "hidden"),
                 Linear("mlp.dense_h_to_4h", "hidden", "ffn"), Linear("mlp.dense_4h_to_h", "ffn", "hidden")),
    "opt": (Linear("self_attn.q_proj", "hidden", "q"), Linear("self_attn.k_proj", "hidden", "kv"),
            Linear("self_attn.v_proj", "hidden", "kv"), Linear("self_attn.out_proj", "q", "hidden"),
            Linear("fc1", "hidden", "ffn"), Linear("fc2", "ffn", "hidden"),
            Linear("project_in", "embed", "hidden", "model"), Linear("project_out", "hidden", "embed", "model")),
}
