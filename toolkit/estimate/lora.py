"""What LoRA and QLoRA change in a model's numbers: the adapter parameters PEFT adds (the trainable count), the base
weights bitsandbytes stores in 4-bit, and the extra FLOPs and activations of the adapters' matmuls.

Sources: PEFT's LoRA layer (peft/tuners/lora/layer.py) adds lora_A (r x in) and lora_B (out x r) to every targeted
linear module and no bias; bitsandbytes' Linear4bit (bitsandbytes/nn/modules.py, Params4bit) packs two nf4 values per
byte and keeps one fp32 absmax per block of 64, which double quantisation stores as uint8 with one fp32 scale per 256
blocks; transformers' bnb quantizer converts every linear module but the output head.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.estimate.params import count_params
from toolkit.families.linears import LINEARS, Linear
from toolkit.spec.finetune import NF4_BLOCK, NF4_SCALE_BLOCK, FinetuneOptions, lora_linears
from toolkit.spec.model import ModelSpec, per_model

# bytes per quantised weight: two nf4 values per byte, the uint8 block scale, and its fp32 scale per 256 blocks
NF4_BYTES = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALE_BLOCK)


def _width(spec: ModelSpec, expression: str) -> int:
    heads = spec.num_attention_heads
    sizes = {"hidden": spec.hidden_size, "q": heads * spec.head_dim,
             "kv": spec.num_kv_heads * spec.head_dim, "ffn": spec.ffn_hidden_size, "embed": spec.embed_proj_dim or 0,
             "q_lora": spec.q_lora_rank or 0, "kv_lora": spec.kv_lora_rank or 0, "rope": spec.qk_rope_head_dim,
             "kv_up": heads * (spec.head_dim - spec.qk_rope_head_dim + spec.value_head_dim),
             "o_in": heads * spec.value_head_dim}
    return sum(sizes[part] for part in expression.split("+"))


def _present(spec: ModelSpec, linear: Linear, layer: int | None) -> bool:
    """Whether the module exists: in this layer (dense-only modules not in MoE layers), or once in the model (OPT's
    projections only with a word_embed_proj_dim)."""
    if linear.where == "model":
        return layer is None and bool(spec.embed_proj_dim)
    if layer is None:
        return False
    return {"dense": not spec.is_moe_layer(layer), "q_lora": bool(spec.q_lora_rank),
            "q_direct": not spec.q_lora_rank}.get(linear.where, True)


@dataclass(frozen=True)
class FinetuneCounts:
    """Per layer and outside the layers: adapter parameters, and base weights stored in 4-bit (qlora)."""

    adapter_layers: tuple[int, ...]
    adapter_outside: int
    quantized_layers: tuple[int, ...]
    quantized_outside: int
    targeted_inputs: tuple[int, ...]  # per layer: the summed input widths of the targeted modules (dropout copies)
    targeted_modules: tuple[int, ...]  # per layer: how many modules carry adapters
    linear_sizes: tuple[int, ...] = ()  # every linear weight of the base, in elements (ZeRO-3 persistence)
    adapter_sizes: tuple[int, ...] = ()  # every lora_A and lora_B matrix, in elements

    @property
    def adapters(self) -> int:
        return sum(self.adapter_layers) + self.adapter_outside

    @property
    def quantized(self) -> int:
        return sum(self.quantized_layers) + self.quantized_outside


@per_model
def finetune_counts(spec: ModelSpec, finetune: FinetuneOptions) -> FinetuneCounts:
    targets = lora_linears(spec.family, finetune.target_modules) if finetune.peft else ()
    every = LINEARS.get(spec.family, ())
    r = finetune.r

    linear_sizes: list[int] = []
    adapter_sizes: list[int] = []

    def tally(layer: int | None) -> tuple[int, int, int, int]:
        adapter = quantized = inputs = modules = 0
        for linear in every:
            if not _present(spec, linear, layer):
                continue
            fan_in, fan_out = _width(spec, linear.in_features), _width(spec, linear.out_features)
            quantized += fan_in * fan_out
            linear_sizes.append(fan_in * fan_out)
            if linear in targets:
                adapter += r * (fan_in + fan_out)
                adapter_sizes.extend((r * fan_in, r * fan_out))
                inputs += fan_in
                modules += 1
        return adapter, quantized, inputs, modules

    per_layer = [tally(i) for i in range(spec.num_layers)]
    outside = tally(None)
    return FinetuneCounts(
        adapter_layers=tuple(p[0] for p in per_layer), adapter_outside=outside[0],
        quantized_layers=tuple(p[1] for p in per_layer) if finetune.method == "qlora" else (0,) * spec.num_layers,
        quantized_outside=outside[1] if finetune.method == "qlora" else 0,
        targeted_inputs=tuple(p[2] for p in per_layer), targeted_modules=tuple(p[3] for p in per_layer),
        linear_sizes=tuple(linear_sizes), adapter_sizes=tuple(adapter_sizes))


def trainable_params(spec: ModelSpec, finetune: FinetuneOptions) -> int:
    """The parameters that train: every one, or the adapters (what PEFT's get_nb_trainable_parameters reports)."""
    if not finetune.peft:
        return count_params(spec).total
    return finetune_counts(spec, finetune).adapters


def adapter_forward_flops(spec: ModelSpec, finetune: FinetuneOptions, layer: int) -> float:
    """Forward FLOPs per token of one layer's adapters: x A^T then (x A^T) B^T, 2 FLOPs per multiply-add."""
    if not finetune.peft:
        return 0.0
    return 2.0 * finetune_counts(spec, finetune).adapter_layers[layer]


def adapter_activation_bytes(spec: ModelSpec, finetune: FinetuneOptions, layer: int, act_bytes: int) -> float:
    """Per token, what one layer's adapters keep for backward: lora_A's output (r wide) for lora_B, and with dropout
    the dropped copy of the input and its mask. The input itself is what the base linear keeps already."""
    if not finetune.peft:
        return 0.0
    counts = finetune_counts(spec, finetune)
    kept = counts.targeted_modules[layer] * finetune.r * act_bytes
    if finetune.dropout > 0:
        kept += counts.targeted_inputs[layer] * (act_bytes + 1)
    return kept
