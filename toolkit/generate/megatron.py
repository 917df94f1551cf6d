"""megatron.yaml (the keyword arguments of Megatron-Core's own classes) and megatron_args.txt (Megatron-LM flags).

megatron.yaml has one section per Megatron-Core object the training backend builds: `transformer_config`
(TransformerConfig, which includes ModelParallelConfig), `gpt_model` (GPTModel), `ddp_config`
(DistributedDataParallelConfig), `optimizer_config` (OptimizerConfig), `scheduler` (OptimizerParamScheduler), plus
`schedule` (micro-batches for get_forward_backward_func) and `model` (family and vocabulary padding). A model with
multi-latent attention (deepseek_v3) keeps MLATransformerConfig's fields in `transformer_config`
(transformer_config_class names the class both the validator and the training backend build). The layer
spec follows TransformerConfig's own `transformer_impl`: Transformer Engine modules on GPUs (fused kernels, fp8, context
parallelism), Megatron-Core's local modules on CPU.
Architecture comes from the family's mapping table; every parallel, batch, precision and recompute number is read
from the resolved Plan, never recomputed. Names that YAML cannot hold (dtypes, the activation function) are stored
as names and turned back into objects by `library_kwargs`.
"""

from __future__ import annotations

from toolkit.data.sidecar import megatron_prefix
from toolkit.data.split import megatron_split
from toolkit.errors import UserInputError
from toolkit.families import megatron_fields
from toolkit.families.activations import megatron_function
from toolkit.numeric import yaml_text
from toolkit.planner.save_interval import recipe_saves_async
from toolkit.spec.engine_settings import MEGATRON_VOCAB_DIVISIBLE_BY, megatron_padded_vocab
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan
from toolkit.spec.quantization import BF16_COMPUTE, FORMAT, FP4, FP8
from toolkit.spec.recipe import Recipe, data_workers

SECTIONS = ("model", "transformer_config", "gpt_model", "ddp_config", "optimizer_config", "scheduler",
            "schedule")
OPTIONAL_SECTIONS = ("data",)  # written for some recipes only: data for a blend
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16", "fp4": "bfloat16"}
DTYPE_FIELDS = ("params_dtype", "pipeline_dtype", "main_params_dtype", "main_grads_dtype")
# the torch dtypes those fields may name: a name is looked up on `torch`, where `manual_seed` is a function, not a dtype
DTYPE_NAMES = ("float32", "float16", "bfloat16")
OPTIMIZERS = {"adamw": "adam", "sgd": "sgd"}  # Megatron's "adam" is AdamW (decoupled weight decay by default)


def _precision(plan: Plan) -> dict:
    dtype = DTYPES[plan.precision]
    fields = {"bf16": plan.precision in BF16_COMPUTE, "fp16": plan.precision == "fp16",
              "params_dtype": dtype, "pipeline_dtype": dtype}
    if plan.precision == FP8:  # E4M3 forward / E5M2 gradients, in the plan's recipe (spec/quantization.py)
        fields.update(fp8=FORMAT[FP8], fp8_recipe=plan.fp8_recipe)
        if plan.fp8_param_gather:  # TransformerConfig.fp8_param: the GEMM weights are fp8 tensors
            fields["fp8_param"] = True
    elif plan.precision == FP4:
        fields.update(fp4=FORMAT[FP4], fp4_recipe=plan.fp4_recipe)
    return fields


def _recompute(plan: Plan) -> dict:
    """TransformerConfig's recompute fields; recompute_modules only when not Megatron-Core's default [core_attn]."""
    if plan.recompute == "selective":
        modules = {} if plan.recompute_modules == ("core_attn",) else {"recompute_modules": list(plan.recompute_modules)}
        return {"recompute_granularity": "selective", **modules}
    if plan.recompute == "full":
        if plan.recompute_num_layers is None:  # every layer, one checkpoint each
            return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        return {"recompute_granularity": "full", "recompute_method": "block",
                "recompute_num_layers": plan.recompute_num_layers}
    return {}


def _parallel(plan: Plan, model: ModelSpec) -> dict:
    # the expert mesh (parallel folding) only where there are experts: dense files stay as they were
    experts = {"expert_tensor_parallel_size": plan.expert_tp} if model.is_moe else {}
    return {
        "tensor_model_parallel_size": plan.tp,
        "pipeline_model_parallel_size": plan.pp,
        "virtual_pipeline_model_parallel_size": plan.vpp if plan.vpp > 1 else None,
        "context_parallel_size": plan.cp,
        "expert_model_parallel_size": plan.ep,
        **experts,
        "sequence_parallel": plan.sequence_parallel,
        **({"pipeline_model_parallel_layout": plan.pipeline_model_parallel_layout}
           if plan.pipeline_model_parallel_layout else {}),
        "num_layers_in_first_pipeline_stage": plan.first_stage_layers,
        "num_layers_in_last_pipeline_stage": plan.last_stage_layers,
        # written only when set (TransformerConfig's default is False), so even splits keep their files unchanged
        **{name: True for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
           if getattr(plan, name)},
    }


AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
AUX_LOSS_COEFF = 1e-3  # router_aux_loss_coef of Mixtral's and Qwen3-MoE's HF configs, where the family sets none


def _moe(plan: Plan, model: ModelSpec, mapped: dict) -> dict:
    """TransformerConfig's MoE fields the plan decides: dispatcher, grouped GEMM, capacity, the all-to-all overlap
    and load balancing."""
    fields = {"moe_token_dispatcher_type": plan.moe_dispatcher, "moe_grouped_gemm": plan.moe_grouped_gemm}
    if plan.moe_capacity_factor is not None:  # tokens beyond the capacity are dropped (lowest probabilities first)
        fields["moe_expert_capacity_factor"] = plan.moe_capacity_factor
    if plan.overlap_moe_expert_parallel_comm:  # ModelParallelConfig's: the combined 1F1B schedule
        fields["overlap_moe_expert_parallel_comm"] = True
    if plan.moe_load_balancing == "expert_bias":  # DeepSeek-V3: a complementary sequence loss at most
        fields["moe_router_enable_expert_bias"] = True
        if mapped.get("moe_router_load_balancing_type") not in ("seq_aux_loss", "none"):
            fields["moe_router_load_balancing_type"] = "none"
    else:
        fields["moe_router_enable_expert_bias"] = False
        if mapped.get("moe_router_load_balancing_type") not in AUX_LOSSES:
            fields["moe_router_load_balancing_type"] = "aux_loss"
        if not mapped.get("moe_aux_loss_coeff"):
            fields["moe_aux_loss_coeff"] = AUX_LOSS_COEFF
    return fields


def check_generatable(mapped: dict) -> None:
    """Attention sinks (gpt_oss) are mapped for `dmt convert`, but megatron_args.txt has no flags for them yet and
    GPTModel's yarn_* attributes are no TransformerConfig fields the validator knows: refused in one line."""
    if mapped["transformer_config"].get("softmax_type") == "learnable":
        raise UserInputError("model.source", "attention sinks (gpt_oss) are mapped for `dmt convert` only: dmt "
                                             "generate does not yet write Megatron-LM's flags for sinks, windows, "
                                             "the clamped SwiGLU and YaRN (yarn_* are no TransformerConfig fields); "
                                             "train it with fsdp")


def megatron_config(recipe: Recipe, model: ModelSpec, plan: Plan, hf_config: dict) -> dict:
    """The megatron.yaml contents for a recipe, its model, its resolved plan and the model's HF config dict."""
    mapped = megatron_fields(hf_config)
    check_generatable(mapped)
    min_lr = float(f"{recipe.training.learning_rate * recipe.training.min_lr_ratio:.6g}")
    on_cpu = recipe.cluster.accelerator == "cpu"
    training = recipe.training
    vocab = mapped["model"]["vocab_size"]
    transformer = {**mapped["transformer_config"], **_parallel(plan, model), **_precision(plan), **_recompute(plan),
                   "transformer_impl": plan.transformer_impl}
    if model.is_moe:
        transformer.update(_moe(plan, model, transformer))
    if model.mtp_layers:  # Megatron-Core trains the multi-token prediction modules on the last stage (memory counts them)
        transformer["mtp_num_layers"] = model.mtp_layers
    if on_cpu:
        transformer["use_cpu_initialization"] = True  # build weights on the CPU (Megatron-Core defaults to the GPU)
    precision = _precision(plan)
    return {
        "model": {"family": hf_config["model_type"], "vocab_size": vocab,
                  "make_vocab_size_divisible_by": MEGATRON_VOCAB_DIVISIBLE_BY,
                  "padded_vocab_size": megatron_padded_vocab(vocab, plan.tp)},
        "transformer_config": transformer,
        "gpt_model": {**mapped["gpt_model"], "vocab_size": megatron_padded_vocab(vocab, plan.tp)},
        "ddp_config": {
            "use_distributed_optimizer": plan.distributed_optimizer,
            "grad_reduce_in_fp32": plan.precision != "fp32" and not plan.grad_reduce_in_bf16,
            "overlap_grad_reduce": not on_cpu,
            "overlap_param_gather": plan.distributed_optimizer and not on_cpu,
        },
        "optimizer_config": {
            "optimizer": OPTIMIZERS[plan.optimizer],
            "lr": training.learning_rate,
            "min_lr": min_lr,
            "weight_decay": training.weight_decay,
            "adam_beta1": training.adam_beta1,
            "adam_beta2": training.adam_beta2,
            "adam_eps": training.adam_eps,
            "sgd_momentum": training.adam_beta1,
            "clip_grad": training.grad_clip,
            "use_distributed_optimizer": plan.distributed_optimizer,
            "bf16": precision["bf16"],
            "fp16": precision["fp16"],
            "params_dtype": precision["params_dtype"],
        },
        "scheduler": {
            "init_lr": 0.0,
            "max_lr": training.learning_rate,
            "min_lr": min_lr if training.lr_scheduler != "constant" else training.learning_rate,
            "lr_warmup_steps": training.warmup_steps,
            "lr_decay_steps": training.max_steps,
            "lr_decay_style": training.lr_scheduler,
            "start_wd": training.weight_decay,
            "end_wd": training.weight_decay,
            "wd_incr_steps": training.max_steps,
            "wd_incr_style": "constant",
        },
        "schedule": {
            "world_size": plan.gpus,
            "data_parallel_size": plan.dp,
            "micro_batch_size": plan.micro_batch,
            "num_microbatches": plan.grad_accum,
            "global_batch_size": plan.global_batch,
            "seq_length": plan.seq_len,
            "train_iters": training.max_steps,
            "seed": training.seed,
            **({"save_interval": training.save_steps} if training.save_steps else {}),
            "async_save": recipe_saves_async(recipe, plan),
        },
        **({"data": data_section(recipe)} if recipe.data.blend else {}),
    }


def data_section(recipe: Recipe) -> dict:
    """megatron.yaml's `data`: a blend's Megatron dataset prefixes with their weights, the split and GPTDataset's
    packing flags (only for a recipe with data.blend; Megatron-Core's loop reads the recipe's own). Paths as the
    recipe writes them: relative ones are relative to the recipe's directory."""
    data = recipe.data
    return {"blend": [{"prefix": megatron_prefix(entry.prefix, data.text_field), "weight": entry.weight}
                      for entry in data.blend],
            "split": megatron_split(data.split),
            **({"cache_dir": data.cache_dir} if data.cache_dir else {}),
            "num_workers": data_workers(recipe), "reset_position_ids": data.reset_position_ids,
            "reset_attention_mask": data.reset_attention_mask, "eod_mask_loss": data.eod_mask_loss}


def megatron_yaml(config: dict, recipe_name: str) -> str:
    header = (f"# Megatron-Core settings of recipe {recipe_name}, written by `dmt generate` (regenerate, do not edit).\n"
              f"# Each section holds the keyword arguments of the Megatron-Core class it names; dtypes and the\n"
              f"# activation function are stored by name.\n")
    return header + yaml_text({k: config[k] for k in (*SECTIONS, *OPTIONAL_SECTIONS) if k in config}, sort_keys=False)


def transformer_config_class(values: dict):
    """The Megatron-Core class a `transformer_config` section feeds: MLATransformerConfig where it asks for
    multi-latent attention (Megatron-LM's core_transformer_config_from_args chooses the same), else TransformerConfig."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if values.get("multi_latent_attention") is True else TransformerConfig


def library_kwargs(section: str, values: dict) -> dict:
    """A megatron.yaml section as the keyword arguments of its Megatron-Core class (dtype and function objects)."""
    import torch

    kwargs = dict(values)
    for name in DTYPE_FIELDS:
        if isinstance(kwargs.get(name), str):
            if kwargs[name] not in DTYPE_NAMES:
                raise ValueError(f"{name} names {kwargs[name]!r}; valid: {', '.join(DTYPE_NAMES)}")
            kwargs[name] = getattr(torch, kwargs[name])
    if section == "transformer_config":
        if isinstance(kwargs.get("activation_func"), str):
            kwargs["activation_func"] = megatron_function(kwargs["activation_func"])
        if isinstance(kwargs.get("window_size"), list):
            kwargs["window_size"] = tuple(kwargs["window_size"])
        if kwargs.get("multi_latent_attention") is True and kwargs.get("kv_channels") is None:
            # MLA's attention output is heads x v_head_dim: the local spec's core attention writes heads x kv_channels
            # (toolkit.compat.megatron_seams.local_mla_core_attention)
            kwargs["kv_channels"] = kwargs.get("v_head_dim", transformer_config_class(kwargs).v_head_dim)
    return kwargs

