"""Megatron-Core's memory terms: its padded vocabulary, fp32 main grads and the distributed optimizer's shards.

Megatron keeps fp32 gradient buffers for bf16 training (bf16 ones with --grad-reduce-in-bf16) and its distributed
optimizer shards the fp32 master weights and Adam moments over the data-parallel (x context-parallel) group: 6 + 12/d
bytes/param (Megatron-LM docs/source/api-guide/dist_optimizer.md, "bf16 param, fp32 grads"; 4 + 12/d with bf16 grads).
"""

from __future__ import annotations

from toolkit.estimate.memory import FP32, ModelStates, StageParams, optimizer_bytes
from toolkit.spec.engine_settings import megatron_padded_vocab
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import PRECISION_BYTES, Plan
from toolkit.spec.quantization import plan_recipe

padded_vocab = megatron_padded_vocab  # the memory part's hook: Megatron pads to 128 x tp


def saved_bytes_per_param(plan: Plan) -> int:
    """Bytes per trained parameter one checkpoint holds: the model's parameters in the training dtype and the
    optimizer's fp32 main parameters and moments (dist_checkpointing's model and optimizer sharded state dicts)."""
    return PRECISION_BYTES[plan.precision] + optimizer_bytes(plan.optimizer, plan.precision != "fp32")


def model_states(spec: ModelSpec, plan: Plan, params: StageParams, layer_params: int) -> ModelStates:
    """(weights, gradients, optimizer, comm buffers, host bytes) on one GPU. Megatron-Core trains every parameter
    (adapters are refused for it, spec/finetune.py) and offloads nothing."""
    w = PRECISION_BYTES[plan.precision]
    opt_bytes = optimizer_bytes(plan.optimizer, plan.precision != "fp32")
    weights = weight_bytes(plan, params)
    gradients = params.total * main_grad_bytes(plan)
    if plan.distributed_optimizer:
        optimizer = opt_bytes * (params.dense / (plan.dp * plan.cp) + params.expert / plan.expert_dp)
    else:
        optimizer = opt_bytes * params.total
    return weights, gradients, int(optimizer), {}, 0


def main_grad_bytes(plan: Plan) -> int:
    """Bytes per parameter of DistributedDataParallel's main-grad buffers, which every rank keeps whole (the
    distributed optimizer shards the optimizer states, not them): fp32 unless --grad-reduce-in-bf16
    (distributed/distributed_data_parallel.py: `grad_dtype = torch.float if self.ddp_config.grad_reduce_in_fp32 else
    param.dtype`; Megatron-LM's validate_args turns grad_reduce_in_fp32 on for bf16 unless --grad-reduce-in-bf16)."""
    return PRECISION_BYTES["bf16"] if plan.grad_reduce_in_bf16 else FP32


def weight_bytes(plan: Plan, params: StageParams) -> int:
    """The model's weights on one GPU: every parameter in the training dtype, and in fp8 / fp4 each GEMM weight's
    quantized copy in both usages (spec/quantization.py), which with --fp8-param-gather replaces its bf16 one."""
    w = PRECISION_BYTES[plan.precision]
    recipe = plan_recipe(plan)
    if recipe is None:
        return params.total * w
    high_precision = params.total - params.gemm if plan.fp8_param_gather else params.total
    return int(high_precision * w + params.gemm * recipe.weight_copy_bytes)


def alive_at_backward_start(plan: Plan, gradients: int, buffers: dict[str, int]) -> int:
    """Bytes of model_states' gradients and buffers that exist when a micro-batch's backward starts: all of them,
    since DistributedDataParallel allocates its fp32 main-grad buffers when it wraps the model
    (distributed/param_and_grad_buffer.py) and keeps them for the run."""
    return gradients + sum(buffers.values())


def step_fp32_grads(spec: ModelSpec, plan: Plan, params: StageParams) -> int:
    """Nothing beyond the main-grad buffers, which model_states counts for the whole run."""
    return 0
