"""Validate a megatron.yaml the way Megatron-Core will: the toolkit's plan rules, the rules Megatron-Core only hits at
run time, then its own config classes (constructing TransformerConfig runs ModelParallelConfig's checks too). Every
problem names the dotted key, the conflicting values and the fix, like the DeepSpeed validator.
"""

from __future__ import annotations

import difflib
import inspect
from pathlib import Path

from toolkit.compat.megatron_seams import te_version_assumed
from toolkit.errors import UserInputError
from toolkit.families.activations import MEGATRON_ACTIVATIONS
from toolkit.generate.megatron import OPTIMIZERS, OPTIONAL_SECTIONS, library_kwargs, transformer_config_class
from toolkit.generate.megatron_args import megatron_args
from toolkit.numeric import COUNT_MAX, SEED_MAX, WEIGHT_MAX, is_finite_number
from toolkit.readers import read_yaml
from toolkit.spec.engine_settings import megatron_padded_vocab
from toolkit.spec.model import ModelSpec
from toolkit.spec.options import RECOMPUTE_MODULES, TRANSFORMER_IMPLS
from toolkit.spec.plan import resolve_plan
from toolkit.spec.quantization import DEFAULT_RECIPE, FP4, FP8, RECIPES
from toolkit.validate import Problem
from toolkit.validate.megatron_fields import DATA_KEYS, MODEL_TYPES, SCHEDULE_KEYS, SCHEDULE_OPTIONAL, field_problems

TC = "transformer_config"
# resolve_plan's flags -> the megatron.yaml key holding that number
PLAN_KEYS = {
    "--tp": f"{TC}.tensor_model_parallel_size", "--pp": f"{TC}.pipeline_model_parallel_size",
    "--vpp": f"{TC}.virtual_pipeline_model_parallel_size", "--cp": f"{TC}.context_parallel_size",
    "--ep": f"{TC}.expert_model_parallel_size", "--etp": f"{TC}.expert_tensor_parallel_size",
    "--gpus": "schedule.world_size",
    "--global-batch": "schedule.global_batch_size", "--micro-batch": "schedule.micro_batch_size",
    "--seq-len": "schedule.seq_length", "--sequence-parallel": f"{TC}.sequence_parallel",
    "--first-stage-layers": f"{TC}.num_layers_in_first_pipeline_stage",
    "--pipeline-model-parallel-layout": f"{TC}.pipeline_model_parallel_layout",
    "--last-stage-layers": f"{TC}.num_layers_in_last_pipeline_stage",
    "--account-for-embedding-in-pipeline-split": f"{TC}.account_for_embedding_in_pipeline_split",
    "--account-for-loss-in-pipeline-split": f"{TC}.account_for_loss_in_pipeline_split",
    "--distributed-optimizer": "ddp_config.use_distributed_optimizer", "--optimizer": "optimizer_config.optimizer",
    "--recompute": f"{TC}.recompute_granularity", "--precision": f"{TC}.bf16",
    "--recompute-modules": f"{TC}.recompute_modules", "--recompute-num-layers": f"{TC}.recompute_num_layers",
    "--fp8-recipe": f"{TC}.fp8_recipe", "--fp4-recipe": f"{TC}.fp4_recipe", "--fp8-param-gather": f"{TC}.fp8_param",
    "--moe-dispatcher": f"{TC}.moe_token_dispatcher_type", "--moe-grouped-gemm": f"{TC}.moe_grouped_gemm",
    "--moe-capacity-factor": f"{TC}.moe_expert_capacity_factor",
    "--moe-load-balancing": f"{TC}.moe_router_enable_expert_bias",
    "--overlap-moe-expert-parallel-comm": f"{TC}.overlap_moe_expert_parallel_comm",
}
LAYER_SPECS = tuple(sorted(TRANSFORMER_IMPLS))  # the layer specs the toolkit builds


def _section_fields(tc: dict) -> dict[str, tuple[str, set[str]]]:
    """Section -> (Megatron-Core class it feeds, the names that class accepts); `transformer_config` feeds
    MLATransformerConfig where `tc` (that section) asks for multi-latent attention."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def params(fn, skip):
        return {p for p in inspect.signature(fn).parameters if p not in skip}

    owner = transformer_config_class(tc)
    return {
        TC: (owner.__name__, {f.name for f in dataclasses.fields(owner)}),
        "gpt_model": ("GPTModel", params(GPTModel.__init__, {"self", "config", "transformer_layer_spec",
                                                             "pre_process", "post_process", "vp_stage",
                                                             "pg_collection", "mtp_block_spec"})),
        "ddp_config": ("DistributedDataParallelConfig",
                       {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}),
        "optimizer_config": ("OptimizerConfig", {f.name for f in dataclasses.fields(OptimizerConfig)}),
        "scheduler": ("OptimizerParamScheduler", params(OptimizerParamScheduler.__init__, {"self", "optimizer"})),
        "schedule": ("the toolkit's schedule", set(SCHEDULE_KEYS) | set(SCHEDULE_OPTIONAL)),
        "model": ("the toolkit's model", set(MODEL_TYPES)),
        "data": ("the toolkit's data blend", set(DATA_KEYS)),
    }


def _structure(config: dict) -> list[Problem]:
    if not isinstance(config, dict):
        return [Problem("megatron.yaml", "must hold a mapping of sections")]
    fields = _section_fields(config.get(TC) if isinstance(config.get(TC), dict) else {})
    problems = [Problem(s, "section missing; regenerate with `dmt generate`") for s in fields
                if s not in config and s not in OPTIONAL_SECTIONS]
    for section, values in config.items():
        if section not in fields:
            close = difflib.get_close_matches(section, list(fields), n=1)
            problems.append(Problem(section, f"is not a section; {f'did you mean {close[0]!r}?' if close else 'remove it'}"))
            continue
        if not isinstance(values, dict):
            problems.append(Problem(section, f"must be a mapping, got {values!r}"))
            continue
        owner, names = fields[section]
        for key in values:
            if key not in names:
                close = difflib.get_close_matches(key, sorted(names), n=1)
                hint = f"did you mean {close[0]!r}?" if close else "remove it"
                problems.append(Problem(f"{section}.{key}", f"is not an option of {owner}; {hint}"))
    return problems


def _integers(config: dict) -> list[Problem]:
    """The sizes the arithmetic below divides by must be positive integers (or null where optional)."""
    keys = [(TC, k) for k in ("num_layers", "num_attention_heads", "tensor_model_parallel_size",
                              "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                              "expert_tensor_parallel_size")]
    keys += [("schedule", k) for k in ("world_size", "micro_batch_size", "num_microbatches", "global_batch_size",
                                       "seq_length", *SCHEDULE_OPTIONAL)] + [("gpt_model", "vocab_size")]
    problems = []
    for section, key in keys:
        value = config[section].get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(Problem(f"{section}.{key}", f"{value!r} is not a positive integer"))
    seed = config["schedule"].get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        problems.append(Problem("schedule.seed", f"{seed!r} is not a seed numpy and torch accept (0 to {SEED_MAX})"))
    return problems


def _model_spec(config: dict):
    tc, gpt = config[TC], config["gpt_model"]
    heads = tc["num_attention_heads"]
    experts = tc.get("num_moe_experts") or 0
    gated = tc.get("gated_linear_unit", False)
    freq = tc.get("moe_layer_freq")
    moe_layers = tuple(i for i, moe in enumerate(freq) if moe) if experts and isinstance(freq, list) else None
    mla = _mla_spec(tc) if tc.get("multi_latent_attention") is True else {}
    return ModelSpec(
        name="megatron.yaml", family=config["model"].get("family", "custom"), num_layers=tc["num_layers"],
        hidden_size=tc["hidden_size"], num_attention_heads=heads, num_kv_heads=tc.get("num_query_groups") or heads,
        head_dim=mla.pop("head_dim", None) or tc.get("kv_channels") or tc["hidden_size"] // heads,
        moe_layers=moe_layers, **mla,
        ffn_hidden_size=tc.get("ffn_hidden_size") or 4 * tc["hidden_size"],
        vocab_size=config["model"].get("vocab_size", gpt["vocab_size"]),
        activation="swiglu" if gated else "gelu", norm="rmsnorm" if tc.get("normalization") == "RMSNorm" else "layernorm",
        position_embedding="learned" if gpt.get("position_embedding_type") == "learned_absolute" else "rope",
        position_embedding_rows=gpt.get("max_sequence_length") or 1,
        num_experts=experts, experts_top_k=tc.get("moe_router_topk") or 0 if experts else 0,
        moe_ffn_hidden_size=tc.get("moe_ffn_hidden_size") if experts else None,
        mlp_bias=bool(tc.get("add_bias_linear", True)),  # TransformerConfig's default: biased linear layers
        moe_router_score=tc.get("moe_router_score_function", "softmax") if experts else "softmax",
        moe_router_expert_bias=bool(tc.get("moe_router_enable_expert_bias")) and bool(experts),
        shared_expert_ffn_hidden_size=(tc.get("moe_shared_expert_intermediate_size") or 0) if experts else 0,
        mtp_layers=tc.get("mtp_num_layers") or 0,
    )


def _mla_spec(tc: dict) -> dict:
    """ModelSpec's multi-latent attention fields of MLATransformerConfig's (its defaults where the file says none)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    def get(name):
        return tc.get(name, getattr(MLATransformerConfig, name))

    return dict(head_dim=get("qk_head_dim") + get("qk_pos_emb_head_dim"), q_lora_rank=get("q_lora_rank"),
                kv_lora_rank=get("kv_lora_rank"), qk_rope_head_dim=get("qk_pos_emb_head_dim"),
                v_head_dim=get("v_head_dim"))


def _modelled_recompute_modules(tc: dict):
    """recompute_modules for the plan rules when the toolkit models them all; Megatron-Core's own check (building
    TransformerConfig, below) judges the others (moe_act, layernorm, ...)."""
    modules = tc.get("recompute_modules")
    if tc.get("recompute_granularity") != "selective" or not isinstance(modules, list):
        return None
    if not all(isinstance(m, str) for m in modules):
        return None
    if tc.get("multi_latent_attention") is not True:  # without MLA, mla_up_proj is TransformerConfig's to judge
        modules = [m for m in modules if m != "mla_up_proj"]
    return modules if modules and set(modules) <= set(RECOMPUTE_MODULES) else None


def _precision(tc: dict) -> str:
    return ("fp8" if tc.get("fp8") else "fp4" if tc.get("fp4") else "bf16" if tc.get("bf16") else
            "fp16" if tc.get("fp16") else "fp32")


def megatron_plan_view(config: dict) -> dict[str, tuple[str, object]]:
    """The plan options a megatron.yaml states: option -> (the file's dotted key, its value)."""
    tc = config[TC]
    view = {
        "gpus": "schedule.world_size", "dp": "schedule.data_parallel_size", "tp": f"{TC}.tensor_model_parallel_size",
        "pp": f"{TC}.pipeline_model_parallel_size", "vpp": f"{TC}.virtual_pipeline_model_parallel_size",
        "cp": f"{TC}.context_parallel_size", "ep": f"{TC}.expert_model_parallel_size",
        "etp": f"{TC}.expert_tensor_parallel_size",
        "micro_batch": "schedule.micro_batch_size", "grad_accum": "schedule.num_microbatches",
        "global_batch": "schedule.global_batch_size", "seq_len": "schedule.seq_length",
        "sequence_parallel": f"{TC}.sequence_parallel",
        "distributed_optimizer": "ddp_config.use_distributed_optimizer",
        "recompute": f"{TC}.recompute_granularity", "transformer_impl": f"{TC}.transformer_impl",
        "first_stage_layers": f"{TC}.num_layers_in_first_pipeline_stage",
        "pipeline_model_parallel_layout": f"{TC}.pipeline_model_parallel_layout",
        "last_stage_layers": f"{TC}.num_layers_in_last_pipeline_stage",
        "account_for_embedding_in_pipeline_split": f"{TC}.account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split": f"{TC}.account_for_loss_in_pipeline_split",
        "optimizer": "optimizer_config.optimizer",
    }
    values = {}
    for name, key in view.items():
        section, field = key.split(".", 1)
        values[name] = (key, config[section].get(field))
    values["vpp"] = (view["vpp"], tc.get("virtual_pipeline_model_parallel_size") or 1)
    experts = bool(tc.get("num_moe_experts"))  # MoE options: None in a dense model's plan
    values["moe_dispatcher"] = (f"{TC}.moe_token_dispatcher_type", tc.get("moe_token_dispatcher_type", "allgather")
                                if experts else None)
    values["moe_grouped_gemm"] = (f"{TC}.moe_grouped_gemm", bool(tc.get("moe_grouped_gemm")) if experts else None)
    values["moe_capacity_factor"] = (f"{TC}.moe_expert_capacity_factor", tc.get("moe_expert_capacity_factor"))
    values["moe_load_balancing"] = (f"{TC}.moe_router_enable_expert_bias", (
        "expert_bias" if tc.get("moe_router_enable_expert_bias") else "aux_loss") if experts else None)
    etp = tc.get("expert_tensor_parallel_size")  # the plan leaves it unset unless folded (etp != tp)
    values["etp"] = (view["etp"], None if etp == tc.get("tensor_model_parallel_size", 1) else etp)
    values["recompute"] = (view["recompute"], tc.get("recompute_granularity") or "none")
    values["optimizer"] = (view["optimizer"], {v: k for k, v in OPTIMIZERS.items()}.get(values["optimizer"][1],
                                                                                        values["optimizer"][1]))
    for flag in ("sequence_parallel", "distributed_optimizer", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split"):
        values[flag] = (view[flag], bool(values[flag][1]))
    values["precision"] = (f"{TC}.bf16", _precision(tc))
    # the recipes as the file names them (TransformerConfig defaults to delayed); `custom` is outside the plan's choices
    values["fp8_recipe"] = (f"{TC}.fp8_recipe", tc.get("fp8_recipe") if tc.get("fp8") else None)
    values["fp4_recipe"] = (f"{TC}.fp4_recipe", tc.get("fp4_recipe") if tc.get("fp4") else None)
    values["fp8_param_gather"] = (f"{TC}.fp8_param", bool(tc.get("fp8_param")))
    # the gradients' dtype (DistributedDataParallelConfig): fp32 unless a 16-bit run turns it off
    values["grad_reduce_in_bf16"] = ("ddp_config.grad_reduce_in_fp32", bool(tc.get("bf16"))
                                     and not config["ddp_config"].get("grad_reduce_in_fp32"))
    values["overlap_moe_expert_parallel_comm"] = (f"{TC}.overlap_moe_expert_parallel_comm",
                                                  bool(tc.get("overlap_moe_expert_parallel_comm")))
    selective = tc.get("recompute_granularity") == "selective"
    # Megatron-Core's default [core_attn] is left out of the file by the generator; () is the plan's "not selective"
    values["recompute_modules"] = (f"{TC}.recompute_modules",
                                   tc.get("recompute_modules", ["core_attn"]) if selective else [])
    block = tc.get("recompute_method") == "block"
    values["recompute_num_layers"] = (f"{TC}.recompute_num_layers", tc.get("recompute_num_layers") if block else None)
    values["zero"] = ("ddp_config", 0)
    values["backend"] = ("megatron.yaml", "megatron")
    return values


def _plan_rules(config: dict) -> list[Problem]:
    """The toolkit's own plan rules (toolkit.spec.plan), applied to the numbers in the file."""
    from pydantic import ValidationError

    tc, schedule = config[TC], config["schedule"]
    try:
        model = _model_spec(config)
    except ValidationError as exc:
        err = exc.errors()[0]
        message = err["msg"].removeprefix("Value error, ")
        return [Problem(f"{TC}.num_query_groups" if "num_kv_heads" in message else TC, message)]
    options = {name: value for name, (_, value) in megatron_plan_view(config).items()
               if name not in ("gpus", "dp", "grad_accum")}
    # an unknown value, or fp8 / CP with the local spec, get the layer-spec rules' own messages below
    local = tc.get("transformer_impl") == "local" and not (tc.get("fp8") or tc.get("fp4")
                                                           or tc.get("context_parallel_size", 1) > 1)
    options.update(gpus_per_node=schedule["world_size"], transformer_impl="local" if local else None,
                   recompute_modules=_modelled_recompute_modules(tc),
                   optimizer=options["optimizer"] if options["optimizer"] in OPTIMIZERS else None)
    try:
        resolve_plan(model, schedule["world_size"], **options)
    except UserInputError as exc:
        return [Problem(PLAN_KEYS.get(exc.key, exc.key), exc.message)]
    return []


def _runtime_rules(config: dict) -> list[Problem]:
    """What Megatron-Core only finds out after launching (or silently gets wrong)."""
    tc, gpt, schedule, model = config[TC], config["gpt_model"], config["schedule"], config["model"]
    tp, pp, cp = (tc.get(k, 1) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                          "context_parallel_size"))
    problems = []
    vocab, tokenizer_vocab = gpt["vocab_size"], model.get("vocab_size", gpt["vocab_size"])
    if vocab % tp:
        problems.append(Problem("gpt_model.vocab_size", f"{vocab} is not divisible by tensor_model_parallel_size "
                                                         f"{tp} (each rank holds an equal slice of the embedding); "
                                                         f"pad it to {megatron_padded_vocab(tokenizer_vocab, tp)}"))
    elif vocab < tokenizer_vocab:
        problems.append(Problem("gpt_model.vocab_size", f"{vocab} is smaller than the tokenizer's vocabulary "
                                                         f"{tokenizer_vocab}; set it to {megatron_padded_vocab(tokenizer_vocab, tp)}"))
    dp = schedule["world_size"] // (tp * pp * cp)
    if schedule.get("data_parallel_size", dp) != dp:
        problems.append(Problem("schedule.data_parallel_size", f"{schedule['data_parallel_size']} but world "
                                                                f"{schedule['world_size']} / (tp x pp x cp) = {dp}"))
    micro, accum = schedule["micro_batch_size"], schedule["num_microbatches"]
    if micro * accum * dp != schedule["global_batch_size"]:
        problems.append(Problem("schedule.num_microbatches", f"{accum} x micro-batch {micro} x dp {dp} != global "
                                                              f"batch {schedule['global_batch_size']}; set it to "
                                                              f"{schedule['global_batch_size'] // max(1, micro * dp)}"))
    ddp_dist, opt_dist = (config[s].get("use_distributed_optimizer", False) for s in ("ddp_config", "optimizer_config"))
    if ddp_dist != opt_dist:
        problems.append(Problem("optimizer_config.use_distributed_optimizer", f"{opt_dist} but ddp_config says "
                                                                               f"{ddp_dist}; set both the same"))
    for flag in ("bf16", "fp16"):
        if bool(tc.get(flag)) != bool(config["optimizer_config"].get(flag)):
            problems.append(Problem(f"optimizer_config.{flag}", f"{config['optimizer_config'].get(flag)} but "
                                                                 f"transformer_config.{flag} is {tc.get(flag)}; the "
                                                                 f"optimizer must keep the model's precision"))
    activation = tc.get("activation_func", "gelu")
    if isinstance(activation, str) and activation not in MEGATRON_ACTIVATIONS:
        problems.append(Problem(f"{TC}.activation_func",
                                f"{activation!r} is not one of {', '.join(MEGATRON_ACTIVATIONS)}"))
    spec = tc.get("transformer_impl", "transformer_engine")
    if spec not in LAYER_SPECS:
        problems.append(Problem(f"{TC}.transformer_impl", f"{spec!r}: use one of {', '.join(LAYER_SPECS)} for training"))
    elif spec == "local" and (cp > 1 or tc.get("fp8") or tc.get("fp4")):
        what = f"context_parallel_size {cp}" if cp > 1 else "fp8" if tc.get("fp8") else "fp4"
        problems.append(Problem(f"{TC}.transformer_impl", f"{what} needs Transformer Engine modules; set it to "
                                                          f"transformer_engine (GPU)"))
    if gpt.get("position_embedding_type") == "learned_absolute" and schedule["seq_length"] > gpt["max_sequence_length"]:
        problems.append(Problem("schedule.seq_length", f"{schedule['seq_length']} exceeds the learned position "
                                                        f"table of {gpt['max_sequence_length']}"))
    scheduler = config["scheduler"]
    if scheduler.get("lr_warmup_steps", 0) >= scheduler.get("lr_decay_steps", 1):
        problems.append(Problem("scheduler.lr_warmup_steps", f"{scheduler['lr_warmup_steps']} must be below "
                                                              f"lr_decay_steps {scheduler['lr_decay_steps']}"))
    return problems


def _library_checks(config: dict) -> list[Problem]:
    """Megatron-Core's own config classes, constructed from the file (their __post_init__ checks run)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    problems = []
    te_version = _assumed_te_version(config[TC])
    for section, cls in ((TC, transformer_config_class(config[TC])), ("ddp_config", DistributedDataParallelConfig),
                         ("optimizer_config", OptimizerConfig)):
        try:
            with te_version_assumed(te_version):
                cls(**library_kwargs(section, config[section]))
        except (ValueError, AssertionError, TypeError, AttributeError) as exc:
            text = " ".join(str(exc).split()) or type(exc).__name__
            if te_version and section == TC and ("transformer-engine" in text or "TE " in text):
                text += (f" (Transformer Engine is not installed here: taken as {te_version}, the oldest Megatron-Core "
                         f"builds this recipe with; on the GPU the installed one decides)")
            named = [k for k in sorted(config[section], key=len, reverse=True) if k in text]
            key = f"{section}.{min(named, key=text.index)}" if named else section
            problems.append(Problem(key, f"Megatron-Core's {cls.__name__} rejects it: {text}"))
    return problems


def _assumed_te_version(tc: dict) -> str | None:
    """The Transformer Engine version TransformerConfig's checks assume where TE is absent (te_version_assumed): the
    oldest one Megatron-Core builds the file's fp8 / fp4 recipe with, so that a check passes only if every TE able to
    run the recipe passes it (MoE fp8's TE >= 1.7 and grouped GEMM's >= 1.11 do). None (nothing assumed) for 16- and
    32-bit plans and recipes outside the plan's choices."""
    precision = FP8 if tc.get("fp8") else FP4 if tc.get("fp4") else None
    if precision is None:
        return None
    recipe = RECIPES.get(tc.get(f"{precision}_recipe") or DEFAULT_RECIPE[precision])
    return recipe.te_version if recipe is not None and recipe.precision == precision else None


def validate_megatron_config(config: dict, world_size: int | None = None) -> list[Problem]:
    """Every problem of a megatron.yaml dict; `world_size` (the processes to launch) defaults to the file's own.
    Megatron-Core's import-time warnings (no Apex, no Transformer Engine on CPU) are held back: the problems are
    the output."""
    import logging
    import warnings

    megatron_log = logging.getLogger("megatron")
    level = megatron_log.level
    megatron_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _validate(config, world_size)
    finally:
        megatron_log.setLevel(level)


def _validate(config: dict, world_size: int | None) -> list[Problem]:
    problems = _structure(config) or field_problems(config)
    if problems:
        return problems
    if world_size is not None and world_size != config["schedule"].get("world_size"):
        return [Problem("schedule.world_size", f"{config['schedule'].get('world_size')} but {world_size} processes "
                                               f"will be launched; regenerate for {world_size} GPUs")]
    problems = _integers(config)
    if problems:
        return problems
    problems = _plan_rules(config) or _runtime_rules(config)
    return problems or _data_problems(config.get("data")) or _library_checks(config) or _argument_problems(config)


def _data_problems(data) -> list[Problem]:
    """The optional data section (a blend) in the shape megatron_args.txt is written from."""
    if data is None:
        return []
    blend = data.get("blend")
    if not isinstance(blend, list) or not blend:
        return [Problem("data.blend", f"{blend!r} is not a list of {{prefix, weight}} entries")]
    problems = []
    for i, entry in enumerate(blend):
        if not isinstance(entry, dict) or set(entry) != {"prefix", "weight"}:
            problems.append(Problem(f"data.blend[{i}]", f"{entry!r} is not a mapping of exactly prefix and weight"))
            continue
        if not isinstance(entry["prefix"], str):
            problems.append(Problem(f"data.blend[{i}].prefix", f"{entry['prefix']!r} is not a dataset prefix"))
        if not is_finite_number(entry["weight"]) or not 0 < entry["weight"] <= WEIGHT_MAX:
            problems.append(Problem(f"data.blend[{i}].weight", f"{entry['weight']!r} is not a weight above 0 and "
                                                               f"at most {WEIGHT_MAX:g}"))
    for key, valid, what in (("split", lambda v: isinstance(v, str), "a split such as 969,30,1"),
                             ("num_workers", lambda v: type(v) is int and 0 <= v <= COUNT_MAX, "a worker count"),
                             ("cache_dir", lambda v: v is None or isinstance(v, str), "a directory"),
                             *((flag, lambda v: isinstance(v, bool), "true or false")
                               for flag in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"))):
        if key not in data and key != "cache_dir":
            problems.append(Problem(f"data.{key}", "is missing; regenerate with `dmt generate` or add it"))
        elif not valid(data.get(key)):
            problems.append(Problem(f"data.{key}", f"{data.get(key)!r} is not {what}"))
    return problems


def _argument_problems(config: dict) -> list[Problem]:
    """megatron_args.txt written from this file would carry each value as one word (argument_word's rule)."""
    try:
        megatron_args(config)
    except UserInputError as exc:
        return [Problem(exc.key, exc.message)]
    return []


def padding_note(config: dict) -> str | None:
    """The vocabulary padding Megatron applies, for the report (not a problem)."""
    vocab, padded = config["model"].get("vocab_size"), config["gpt_model"].get("vocab_size")
    if vocab is None or padded is None or padded == vocab:
        return None
    tp = config[TC].get("tensor_model_parallel_size", 1)
    return f"vocabulary {vocab} padded to {padded} (+{padded - vocab} rows, multiple of " \
           f"{config['model'].get('make_vocab_size_divisible_by', 128)} x tp {tp})"


def read_megatron_yaml(path: Path) -> dict:
    return read_yaml(path, "FILE", what="a megatron.yaml (a mapping of Megatron-Core sections)")
