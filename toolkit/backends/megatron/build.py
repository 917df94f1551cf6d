"""Build Megatron-Core's own objects from a megatron.yaml dict: process groups, GPTModel chunks, DDP, optimizer, scheduler.

Nothing here implements parallelism: every object is Megatron-Core's, built the way Megatron-LM's training loop
builds it (parallel_state, layer spec, Float16Module for bf16/fp16, DistributedDataParallel, get_megatron_optimizer,
OptimizerParamScheduler, the schedule from get_forward_backward_func).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from toolkit.compat.megatron_seams import (
    local_mla_core_attention,
    mla_without_transformer_engine,
    moe_without_transformer_engine,
    sequence_parallel_spec,
)
from toolkit.errors import UserInputError
from toolkit.generate.megatron import library_kwargs, transformer_config_class

log = logging.getLogger(__name__)


@dataclass
class MegatronSetup:
    """The built training objects of one rank."""

    config: dict  # the megatron.yaml dict
    transformer_config: object  # megatron.core TransformerConfig
    model: list  # DDP-wrapped model chunks (several with virtual pipeline stages)
    optimizer: object  # MegatronOptimizer (ChainedOptimizer)
    scheduler: object  # OptimizerParamScheduler


def device_context():
    """Where Megatron-Core runs: as is on a GPU, inside the CPU compatibility layer without one."""
    import torch

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from toolkit.compat.megatron_cpu import cuda_on_cpu  # lazy: megatron (CPU ranks only)

    return cuda_on_cpu()


def init_distributed() -> None:
    """The default process group: nccl on GPUs (one per local rank), gloo on CPU ranks."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def initialize_parallel(config: dict) -> None:
    """Megatron-Core's process groups for the file's TP/PP/VPP/CP/EP, and its seeded RNG streams."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    tc = config["transformer_config"]
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tc["tensor_model_parallel_size"],
        pipeline_model_parallel_size=tc["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=tc.get("virtual_pipeline_model_parallel_size"),
        context_parallel_size=tc["context_parallel_size"],
        expert_model_parallel_size=tc["expert_model_parallel_size"],
        expert_tensor_parallel_size=tc.get("expert_tensor_parallel_size"),  # None: the attention's TP
    )
    model_parallel_cuda_manual_seed(config["schedule"]["seed"])


def transformer_config(config: dict):
    """TransformerConfig, or MLATransformerConfig where the file asks for multi-latent attention
    (toolkit.generate.megatron.transformer_config_class, the class the validator builds too)."""
    kwargs = library_kwargs("transformer_config", config["transformer_config"])
    if kwargs.get("virtual_pipeline_model_parallel_size") is None:
        kwargs.pop("virtual_pipeline_model_parallel_size", None)
    # GPTModel's YaRN reads yarn_* attributes TransformerConfig does not declare (gpt_model.py, Megatron-Core 0.16.1);
    # the attention applies YaRN's factor wherever yarn_rotary_scaling_factor is set: none are set without YaRN
    yarn = {name: kwargs.pop(name) for name in list(kwargs) if name.startswith("yarn_")}
    yarn = yarn if yarn.get("yarn_rotary_scaling_factor") is not None else {}
    config = transformer_config_class(kwargs)(**kwargs)
    for name, value in yarn.items():
        setattr(config, name, value)
    return config


def layer_spec(config: dict, tc, vp_stage: int | None = None):
    """The layer spec of `transformer_impl`: Transformer Engine modules (GPU) or Megatron-Core's own (`local`, CPU);
    with multi-latent attention or dense layers among MoE ones (moe_layer_freq a list), the block spec of this stage's
    layers (get_gpt_decoder_block_spec)."""
    from megatron.core.models.gpt import gpt_layer_specs

    te = tc.transformer_impl == "transformer_engine"
    if te:
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise UserInputError("transformer_config.transformer_impl", "transformer_engine is not installed here; "
                                                                        "install it, or set megatron.transformer_impl: "
                                                                        "local in the recipe (no fp8, no context "
                                                                        "parallelism)") from None
    if tc.multi_latent_attention or isinstance(tc.moe_layer_freq, list):
        mla_without_transformer_engine()
        block = gpt_layer_specs.get_gpt_decoder_block_spec(tc, use_transformer_engine=te,
                                                           normalization=tc.normalization, vp_stage=vp_stage)
        if tc.multi_latent_attention and not te:
            attention = local_mla_core_attention()
            for layer in block.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = attention
        return block
    moe = dict(num_experts=tc.num_moe_experts, moe_grouped_gemm=tc.moe_grouped_gemm, qk_layernorm=tc.qk_layernorm)
    if te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    return gpt_layer_specs.get_gpt_layer_local_spec(**moe, normalization=tc.normalization)


def mtp_spec(tc, block, vp_stage: int | None):
    """The multi-token prediction block (mtp_num_layers, DeepSeek-V3's) as Megatron-LM's gpt_builder makes it: each
    MTP layer a copy of the decoder's last layer; None without MTP or on a stage that holds none. GPTModel computes
    the MTP loss whenever mtp_num_layers is set, so the block must be built where the config asks for it."""
    if not tc.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(tc, block, use_transformer_engine=tc.transformer_impl == "transformer_engine",
                                  vp_stage=vp_stage)


def build_model_chunks(config: dict, tc, to_gpu: bool = True) -> list:
    """GPTModel chunks of this rank: one per virtual pipeline stage (the first and last stages hold the embedding
    and the output layer), moved to the GPU where there is one unless `to_gpu` is false (a meta-device model)."""
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if tc.num_moe_experts:
        moe_without_transformer_engine()
    vpp = tc.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        block = layer_spec(config, tc, vp_stage)
        mtp = mtp_spec(tc, block, vp_stage)
        if tc.sequence_parallel and tc.transformer_impl == "local":
            block = sequence_parallel_spec(block, get_num_layers_to_build(tc, vp_stage=vp_stage))
            mtp = mtp and sequence_parallel_spec(mtp, 0)  # the MTP layers' norms, their enorm and hnorm too
        model = GPTModel(
            config=tc, transformer_layer_spec=block, vp_stage=vp_stage, mtp_block_spec=mtp,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage),
            **config["gpt_model"],
        )
        model.vp_stage = vp_stage
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if to_gpu and torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if tc.bf16 or tc.fp16:
            model = Float16Module(tc, model)
        chunks.append(model)
    return chunks


def build(config: dict) -> MegatronSetup:
    """Every training object of this rank from the megatron.yaml dict (process groups must not exist yet)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    initialize_parallel(config)
    tc = transformer_config(config)
    chunks = build_model_chunks(config, tc)
    ddp_config = DistributedDataParallelConfig(**library_kwargs("ddp_config", config["ddp_config"]))
    model = [DistributedDataParallel(tc, ddp_config, chunk, disable_bucketing=index > 0)
             for index, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(OptimizerConfig(**library_kwargs("optimizer_config",
                                                                        config["optimizer_config"])), model)
    scheduler = OptimizerParamScheduler(optimizer, **config["scheduler"])
    # what Megatron-LM's train() wires into the config before the first step
    tc.finalize_model_grads_func = finalize_model_grads
    tc.grad_scale_func = optimizer.scale_loss
    if ddp_config.overlap_grad_reduce:  # Megatron-LM's defaults: align grad reduce and param gather with the schedule
        tc.no_sync_func = _per_chunk(model, "no_sync")
        tc.grad_sync_func = _per_chunk(model, "start_grad_sync")
    if ddp_config.overlap_param_gather:
        tc.param_sync_func = _per_chunk(model, "start_param_sync")
    return MegatronSetup(config, tc, model, optimizer, scheduler)


def _per_chunk(model: list, method: str):
    functions = [getattr(chunk, method) for chunk in model]
    return functions if len(functions) > 1 else functions[0]


def unwrapped(setup: MegatronSetup) -> list:
    """The GPTModel inside each DDP (and Float16Module) wrapper."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(setup.model)


def destroy() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
