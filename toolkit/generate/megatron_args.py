"""megatron_args.txt: the Megatron-LM `pretrain_gpt.py` flags equivalent to a megatron.yaml, one per line.

The table below is the one place that knows Megatron-LM's flag names (checked against Megatron-LM's own parser of
the Megatron-Core 0.16 line, see tests/megatron/megatron_lm_flags.txt). Data, tokenizer and checkpoint paths are the
user's to add.
"""

from __future__ import annotations

from toolkit.errors import UserInputError
from toolkit.outputs import one_word

# (section, field, flag): `--flag value` when the value is set (None and False emit nothing, True emits `--flag`)
VALUE_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("transformer_config", "num_layers", "--num-layers"),
    ("transformer_config", "hidden_size", "--hidden-size"),
    ("transformer_config", "ffn_hidden_size", "--ffn-hidden-size"),
    ("transformer_config", "num_attention_heads", "--num-attention-heads"),
    ("transformer_config", "kv_channels", "--kv-channels"),
    ("transformer_config", "normalization", "--normalization"),
    ("transformer_config", "layernorm_epsilon", "--norm-epsilon"),
    ("transformer_config", "qk_layernorm", "--qk-layernorm"),
    ("transformer_config", "init_method_std", "--init-method-std"),
    ("transformer_config", "hidden_dropout", "--hidden-dropout"),
    ("transformer_config", "attention_dropout", "--attention-dropout"),
    ("transformer_config", "num_moe_experts", "--num-experts"),
    ("transformer_config", "moe_router_topk", "--moe-router-topk"),
    ("transformer_config", "moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("transformer_config", "moe_aux_loss_coeff", "--moe-aux-loss-coeff"),
    ("transformer_config", "moe_router_load_balancing_type", "--moe-router-load-balancing-type"),
    ("transformer_config", "moe_token_dispatcher_type", "--moe-token-dispatcher-type"),
    ("transformer_config", "moe_grouped_gemm", "--moe-grouped-gemm"),
    ("transformer_config", "moe_expert_capacity_factor", "--moe-expert-capacity-factor"),
    ("transformer_config", "moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
    ("transformer_config", "overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm"),
    ("transformer_config", "moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
    ("transformer_config", "moe_router_score_function", "--moe-router-score-function"),
    ("transformer_config", "moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor"),
    ("transformer_config", "moe_router_num_groups", "--moe-router-num-groups"),
    ("transformer_config", "moe_router_group_topk", "--moe-router-group-topk"),
    ("transformer_config", "moe_router_dtype", "--moe-router-dtype"),
    ("transformer_config", "mtp_num_layers", "--mtp-num-layers"),
    # multi-latent attention (MLATransformerConfig; Megatron-LM's _add_mla_args and --rope-type)
    ("transformer_config", "multi_latent_attention", "--multi-latent-attention"),
    ("transformer_config", "q_lora_rank", "--q-lora-rank"),
    ("transformer_config", "kv_lora_rank", "--kv-lora-rank"),
    ("transformer_config", "qk_head_dim", "--qk-head-dim"),
    ("transformer_config", "qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"),
    ("transformer_config", "v_head_dim", "--v-head-dim"),
    ("transformer_config", "rotary_base", "--rotary-base"),
    ("transformer_config", "rope_type", "--rope-type"),
    ("transformer_config", "rotary_scaling_factor", "--rotary-scaling-factor"),
    ("transformer_config", "mscale", "--mscale"),
    ("transformer_config", "mscale_all_dim", "--mscale-all-dim"),
    ("transformer_config", "tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("transformer_config", "pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("transformer_config", "virtual_pipeline_model_parallel_size", "--num-virtual-stages-per-pipeline-rank"),
    ("transformer_config", "pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
    ("transformer_config", "num_layers_in_first_pipeline_stage", "--decoder-first-pipeline-num-layers"),
    ("transformer_config", "num_layers_in_last_pipeline_stage", "--decoder-last-pipeline-num-layers"),
    ("transformer_config", "account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
    ("transformer_config", "account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
    ("transformer_config", "context_parallel_size", "--context-parallel-size"),
    ("transformer_config", "expert_model_parallel_size", "--expert-model-parallel-size"),
    ("transformer_config", "expert_tensor_parallel_size", "--expert-tensor-parallel-size"),
    ("transformer_config", "sequence_parallel", "--sequence-parallel"),
    ("transformer_config", "bf16", "--bf16"),
    ("transformer_config", "fp16", "--fp16"),
    ("transformer_config", "fp8", "--fp8-format"),
    ("transformer_config", "fp8_recipe", "--fp8-recipe"),
    ("transformer_config", "fp8_param", "--fp8-param-gather"),
    ("transformer_config", "fp4", "--fp4-format"),
    ("transformer_config", "fp4_recipe", "--fp4-recipe"),
    ("transformer_config", "recompute_granularity", "--recompute-granularity"),
    ("transformer_config", "recompute_method", "--recompute-method"),
    ("transformer_config", "recompute_num_layers", "--recompute-num-layers"),
    ("transformer_config", "use_cpu_initialization", "--use-cpu-initialization"),
    ("transformer_config", "transformer_impl", "--transformer-impl"),
    ("gpt_model", "max_sequence_length", "--max-position-embeddings"),
    ("gpt_model", "position_embedding_type", "--position-embedding-type"),
    ("gpt_model", "rotary_base", "--rotary-base"),
    ("gpt_model", "rope_scaling", "--use-rope-scaling"),
    ("model", "make_vocab_size_divisible_by", "--make-vocab-size-divisible-by"),
    ("ddp_config", "use_distributed_optimizer", "--use-distributed-optimizer"),
    ("ddp_config", "grad_reduce_in_fp32", "--accumulate-allreduce-grads-in-fp32"),
    ("ddp_config", "overlap_grad_reduce", "--overlap-grad-reduce"),
    ("ddp_config", "overlap_param_gather", "--overlap-param-gather"),
    ("optimizer_config", "optimizer", "--optimizer"),
    ("optimizer_config", "lr", "--lr"),
    ("optimizer_config", "min_lr", "--min-lr"),
    ("optimizer_config", "weight_decay", "--weight-decay"),
    ("optimizer_config", "adam_beta1", "--adam-beta1"),
    ("optimizer_config", "adam_beta2", "--adam-beta2"),
    ("optimizer_config", "adam_eps", "--adam-eps"),
    ("optimizer_config", "clip_grad", "--clip-grad"),
    ("scheduler", "lr_warmup_steps", "--lr-warmup-iters"),
    ("scheduler", "lr_decay_steps", "--lr-decay-iters"),
    ("scheduler", "lr_decay_style", "--lr-decay-style"),
    ("schedule", "micro_batch_size", "--micro-batch-size"),
    ("schedule", "global_batch_size", "--global-batch-size"),
    ("schedule", "seq_length", "--seq-length"),
    ("schedule", "train_iters", "--train-iters"),
    ("schedule", "save_interval", "--save-interval"),
    ("schedule", "seed", "--seed"),
)


def _activation(config: dict) -> list[str]:
    transformer = config["transformer_config"]
    name, gated = transformer.get("activation_func", "gelu"), transformer.get("gated_linear_unit", False)
    flags = {("silu", True): ["--swiglu"], ("openai_gelu", False): ["--openai-gelu"],
             ("squared_relu", False): ["--squared-relu"], ("gelu", False): []}
    if (name, gated) not in flags:
        raise ValueError(f"Megatron-LM has no flag for activation {name} (gated={gated})")
    return flags[(name, gated)]


def _special(config: dict) -> list[str]:
    """Flags that are not one field each: negations, GQA's switch, the window tuple, rope scaling, the format."""
    transformer, gpt = config["transformer_config"], config["gpt_model"]
    flags = _activation(config)
    if transformer.get("num_query_groups") and transformer["num_query_groups"] != transformer["num_attention_heads"]:
        flags += ["--group-query-attention",
                  _flag("--num-query-groups", transformer["num_query_groups"], "transformer_config.num_query_groups")]
    if transformer.get("add_bias_linear") is False:
        flags.append("--disable-bias-linear")
        if transformer.get("add_qkv_bias"):
            flags.append("--add-qkv-bias")
    if transformer.get("window_size"):
        flags.append(_flag("--window-size", ",".join(str(v) for v in transformer["window_size"]),
                           "transformer_config.window_size"))
    flags += _mla(transformer)
    if isinstance(transformer.get("moe_layer_freq"), list):
        flags.append(f"--moe-layer-freq {moe_layer_pattern(transformer['moe_layer_freq'])}")
    if gpt.get("rope_scaling"):
        flags.append(_flag("--rope-scaling-factor", gpt["rope_scaling_factor"], "gpt_model.rope_scaling_factor"))
    if not gpt.get("share_embeddings_and_output_weights"):
        flags.append("--untie-embeddings-and-output-weights")
    if transformer.get("recompute_modules"):  # nargs='*' in Megatron-LM's parser
        flags.append("--recompute-modules " + " ".join(
            argument_word(module, f"transformer_config.recompute_modules[{i}]")
            for i, module in enumerate(transformer["recompute_modules"])))
    if config["optimizer_config"]["optimizer"] == "sgd":
        flags.append(_flag("--sgd-momentum", config["optimizer_config"]["sgd_momentum"],
                           "optimizer_config.sgd_momentum"))
    if transformer.get("bf16") and not config["ddp_config"].get("grad_reduce_in_fp32"):
        # validate_args turns --accumulate-allreduce-grads-in-fp32 on under --bf16 unless --grad-reduce-in-bf16
        flags.append("--grad-reduce-in-bf16")
    flags.append("--ckpt-format torch_dist")
    flags += _data(config.get("data"))
    if config["schedule"]["async_save"]:  # dist_checkpointing's asynchronous save needs its persistent worker
        flags += ["--async-save", "--use-persistent-ckpt-worker"]
    return flags


# MLATransformerConfig's YaRN fields Megatron-LM has no flag for: its config takes the class's defaults
# (megatron.training.arguments.core_transformer_config_from_args copies only the fields its parser has)
MLA_UNFLAGGED = ("original_max_position_embeddings", "beta_fast", "beta_slow")


def _mla(transformer: dict) -> list[str]:
    """Multi-latent attention's flags beyond VALUE_FLAGS: Megatron-LM fuses rope unless told not to, and
    MLATransformerConfig fuses only YaRN's; YaRN's fields without a flag must be the class's defaults, and there are
    no query groups (Megatron-LM's validate_args)."""
    if transformer.get("multi_latent_attention") is not True:
        return []
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    groups, heads = transformer.get("num_query_groups"), transformer.get("num_attention_heads")
    if groups and groups != heads:
        raise UserInputError("transformer_config.num_query_groups", f"{groups} with multi-latent attention, which "
                                                                    f"gives each of the {heads} heads its own keys and "
                                                                    f"values (Megatron-LM refuses "
                                                                    f"--group-query-attention with it): set it to "
                                                                    f"{heads} or remove it")
    rope = transformer.get("rope_type", MLATransformerConfig.rope_type)
    if rope != "yarn":
        return ["--no-rope-fusion"] if not transformer.get("apply_rope_fusion") else []
    for name in MLA_UNFLAGGED:
        if name in transformer and transformer[name] != getattr(MLATransformerConfig, name):
            raise UserInputError(f"transformer_config.{name}", f"{transformer[name]!r} (the model's YaRN rope): "
                                                               f"Megatron-LM's pretrain_gpt.py has no flag for it and "
                                                               f"would train with MLATransformerConfig's "
                                                               f"{getattr(MLATransformerConfig, name)!r}, so "
                                                               f"megatron_args.txt cannot say this model")
    return []


def moe_layer_pattern(freq: list) -> str:
    """moe_layer_freq (1 MoE, 0 dense per layer) as Megatron-LM's --moe-layer-freq reads it: the integer 1 when every
    layer is MoE, else the list pattern its moe_freq_type evaluates ([0]*3+[1]*58: runs of equal entries). The
    pattern's [ and * are glob characters: megatron_args.txt says to read it with globbing off (set -f)."""
    if all(v == 1 for v in freq):
        return "1"
    runs: list[list[int]] = []
    for value in freq:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return "+".join(f"[{value}]*{count}" for value, count in runs)


def _data(data: dict | None) -> list[str]:
    """A blend's flags: --data-path W1 PREFIX1 W2 PREFIX2 ... (Megatron-LM normalises the weights; relative prefixes
    are the recipe's, relative to its directory: run from there), --split and GPTDataset's packing switches."""
    if not data:
        return []
    pairs = [f"{argument_word(entry['weight'], f'data.blend[{i}].weight')} "
             f"{argument_word(entry['prefix'], f'data.blend[{i}].prefix')}" for i, entry in enumerate(data["blend"])]
    flags = ["--data-path " + " ".join(pairs), _flag("--split", data["split"], "data.split"),
             _flag("--num-workers", data["num_workers"], "data.num_workers")]
    if data.get("cache_dir"):
        flags.append(_flag("--data-cache-path", data["cache_dir"], "data.cache_dir"))
    return flags + [f"--{name.replace('_', '-')}" for name in ("reset_position_ids", "reset_attention_mask",
                                                               "eod_mask_loss") if data[name]]


def _value(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def argument_word(value, key: str) -> str:
    """`value` as one word of megatron_args.txt (the writer rule of generated files: toolkit.outputs.one_word)."""
    return one_word(_value(value), key)


def _flag(flag: str, value, key: str) -> str:
    return f"{flag} {argument_word(value, key)}"


def megatron_args(config: dict) -> list[str]:
    """Megatron-LM flags of a megatron.yaml dict, one `--flag [value]` string each; every value one word
    (argument_word)."""
    return value_flags(config) + _special(config)


def value_flags(config: dict) -> list[str]:
    """The flags of VALUE_FLAGS: one field each (sections the dict lacks give none)."""
    flags = []
    # Megatron-LM's validate_args takes the interleaving from a layout and refuses it given twice
    derived = {"virtual_pipeline_model_parallel_size"} if config["transformer_config"].get(
        "pipeline_model_parallel_layout") else set()
    for section, name, flag in VALUE_FLAGS:
        value = config.get(section, {}).get(name)
        if value is None or value is False or name in derived:
            continue
        flags.append(flag if value is True else _flag(flag, value, f"{section}.{name}"))
    return flags


def _patterned(config: dict) -> bool:
    """Whether a flag carries a list pattern (--moe-layer-freq [0]*3+[1]*58), which the shell must not glob."""
    freq = config["transformer_config"].get("moe_layer_freq")
    return isinstance(freq, list) and moe_layer_pattern(freq) != "1"


def megatron_args_text(config: dict, recipe_name: str) -> str:
    vocab = config["model"]
    lines = [
        f"# Megatron-LM pretrain_gpt.py arguments of recipe {recipe_name}, written by `dmt generate`.",
        f"# Usage: {'set -f; ' if _patterned(config) else ''}torchrun ... pretrain_gpt.py "
        f"$(grep -v '^#' megatron_args.txt) {'' if config.get('data') else '--data-path ... '}--tokenizer-type ...",
        f"# Vocabulary {vocab['vocab_size']}: Megatron-LM pads it to {vocab['padded_vocab_size']} "
        f"(multiple of {vocab['make_vocab_size_divisible_by']} x tp).",
    ]
    return "\n".join(lines + megatron_args(config)) + "\n"
