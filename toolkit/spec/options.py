"""The plan's options, declared once: each one's type, choices, default and help text.

Everything else is derived from `PlanOptions`: the recipe's `plan:` section (`toolkit.spec.recipe_cluster`), the flags of
`dmt estimate / plan / generate / restore-test` and of `toolkit/train.py` (`toolkit.cli.options`), the choices the
validators accept, and the resolved `Plan` (`toolkit.spec.plan`), which adds the rules between options. Adding an
option is one field here plus its rule in plan.py.

A field's `recipe` extra names its recipe key where that is not `plan.<name>` (sizes the recipe keeps under
`cluster:` or `training:`); `default_note` describes a default that depends on other options.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from pydantic.fields import FieldInfo

from toolkit.numeric import FINITE, PositiveInt
from toolkit.spec.backends import NAMES

Backend = Literal[NAMES]  # the registry's backends (toolkit/backends/__init__.py)
ZeroStage = Literal[0, 1, 2, 3]
Precision = Literal["bf16", "fp16", "fp32", "fp8", "fp4"]
# the scale-out network between NVLink domains: its default bandwidth, efficiency and latency are in estimate/comm.py
ScaleOut = Literal["infiniband", "roce", "ethernet"]
Recompute = Literal["none", "selective", "full"]
# Megatron-Core's selective-recompute modules (TransformerConfig.recompute_modules, 0.16.1): core attention, the dense
# MLP, and for MoE models the experts' activation function (grouped GEMM only), the whole MoE layer, the norms, MLA's
# up-projections (multi-latent attention only) and the shared experts
RecomputeModule = Literal["core_attn", "mlp", "moe_act", "moe", "layernorm", "mla_up_proj", "shared_experts"]
# Megatron-Core layer modules: Transformer Engine's fused ones, or its own `local` ones (unfused attention and SwiGLU)
TransformerImpl = Literal["transformer_engine", "local"]
# transformers' attn_implementation names, passed to the HF models as they are (hf_trainer.py, peft_model.py)
Attention = Literal["sdpa", "eager", "flash_attention_2"]
Optimizer = Literal["adamw", "adamw8bit", "sgd"]
Offload = Literal["none", "cpu", "nvme"]
# Megatron-Core's MoE token dispatchers (moe_token_dispatcher_type); flex runs DeepEP's kernels (GPUs only)
MoeDispatcher = Literal["alltoall", "allgather", "flex"]
# how the router keeps experts loaded: GShard's auxiliary loss, or DeepSeek-V3's per-expert score bias moved by load
# (aux-loss-free; Megatron-Core's moe_router_enable_expert_bias, sigmoid routers only)
MoeBalancing = Literal["aux_loss", "expert_bias"]
ActivationOffload = Literal["none", "cpu"]
# Megatron-Core's own names for Transformer Engine's recipes (TransformerConfig.fp8_recipe / fp4_recipe, without its
# `custom`, which takes a user's quantizer factory): what each stores and needs is toolkit/spec/quantization.py
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
Fp4Recipe = Literal["nvfp4"]

# MoE routing imbalance when the plan does not state one (--moe-imbalance): real routing of GLM-5's MoE layers (128
# experts, EP 8, no auxiliary loss, H100) leaves 18.6% of GPU time per MoE layer waiting for the busiest rank
# (FEPLB, arXiv:2604.19654v1, Fig. 1b), so busiest / mean = 1 / (1 - 0.186) = 1.23; published throughput runs
# forced-balanced routing (1.0)
MOE_IMBALANCE_DEFAULT = 1.23
MOE_IMBALANCE_NOTE = ("1.23: real routing, GLM-5 MoE layers at EP 8 lose 18.6% of their time to the busiest rank "
                      "(FEPLB, arXiv:2604.19654)")
MOE_IMBALANCE_MAX = 1024.0  # the busiest of at most 1,024 EP ranks holding every routed token

# the backends an option belongs to (an option without is every backend's), by their registry names
DEEPSPEED, MEGATRON, FSDP = ("deepspeed",), ("megatron",), ("fsdp",)
# attention kernels that keep no s x s matrix (eager keeps the probabilities)
FUSED_ATTENTION: tuple[str, ...] = ("sdpa", "flash_attention_2")
# attention kernels that take packed documents apart in a variable-length kernel: transformers' flash attention turns
# position ids that restart into cu_seqlens (modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids),
# so attention costs the documents' squares, not the sequence's (sdpa and eager mask the whole score matrix)
VARIABLE_LENGTH_ATTENTION: tuple[str, ...] = ("flash_attention_2",)
# attention kernels transformers runs a model with attention sinks (GPT-OSS) on: GptOssPreTrainedModel sets
# _supports_sdpa = False, so sdpa raises a ValueError at load (transformers 5.x modeling_gpt_oss.py); eager adds the
# sinks to its softmax and flash_attention_2 is swapped for a sinks-aware kernel (_compatible_flash_implementations)
SINK_ATTENTION: tuple[str, ...] = ("eager", "flash_attention_2")
# what the CUDA-only kernels leave to CPU ranks (flash-attn is a CUDA extension)
CPU_ATTENTION: tuple[str, ...] = ("sdpa", "eager")


def option(default: Any, description: str, *, recipe: str | None = None, default_note: str | None = None,
           metavar: str | None = None, backends: tuple[str, ...] | None = None, off: Any = None) -> Any:
    """A PlanOptions field: its default and help text, where a recipe keeps it when not under `plan:`, the
    backends it belongs to (None: all), and (`off`) a value besides the default that leaves it unused."""
    extra = {key: value for key, value in (("recipe", recipe), ("default_note", default_note), ("metavar", metavar),
                                           ("backends", backends), ("off", off)) if value is not None}
    return Field(default, description=description, json_schema_extra=extra or None)


class PlanOptions(BaseModel):
    """Every option of a parallel plan a user can set. Sizes are per job; `None` defaults are derived (see the note)."""

    model_config = ConfigDict(extra="forbid", frozen=True, **FINITE)

    backend: Backend = option("deepspeed", "training library")
    gpus_per_node: PositiveInt = option(8, "GPUs (processes) per node", recipe="cluster.gpus_per_node")
    nvlink_domain: PositiveInt | None = option(
        None, "GPUs sharing one NVLink/NVSwitch fabric, whole nodes (72 on a GB200/GB300 NVL72 rack of 4-GPU nodes, "
              "8 on HGX): tensor, expert and context parallelism inside it run at NVLink rates",
        recipe="cluster.nvlink_domain", default_note="the GPU's (catalogue), else gpus_per_node", metavar="N")
    network: ScaleOut = option("infiniband", "the scale-out network between NVLink domains (its per-GPU bandwidth, "
                                             "collective efficiency and latency: toolkit/estimate/comm.py)",
                               recipe="cluster.network")
    tp: PositiveInt = option(1, "tensor-parallel size")
    pp: PositiveInt = option(1, "pipeline-parallel stages")
    vpp: PositiveInt = option(1, "virtual pipeline stages per rank (Megatron-Core interleaving)")
    cp: PositiveInt = option(1, "context-parallel size (Megatron-Core; FSDP2: torch context parallel through "
                                "Accelerate's ParallelismConfig cp_size)", backends=MEGATRON + FSDP)
    sp: PositiveInt = option(1, "Ulysses sequence-parallel degree (DeepSpeed under HF Trainer: Accelerate's "
                                "ParallelismConfig sp_size)", backends=DEEPSPEED)
    ep: PositiveInt = option(1, "expert-parallel size (MoE models)")
    etp: PositiveInt | None = option(
        None, "expert tensor-parallel size: Megatron-Core's parallel folding runs the expert layers on ETP x EP x EDP x "
              "PP over the same ranks as attention's TP x CP x DP x PP (--expert-tensor-parallel-size)",
        default_note="tp", metavar="N", backends=MEGATRON)
    moe_imbalance: float | None = option(
        None, "MoE: expected ratio of the busiest expert rank's routed tokens to the mean (1.0: perfectly balanced "
              "routing, as most published MoE throughput is measured)", default_note=MOE_IMBALANCE_NOTE, metavar="F")
    # MoE under Megatron-Core (TransformerConfig's moe_* fields): what the planner searches and the generators write
    moe_dispatcher: MoeDispatcher | None = option(
        None, "MoE token dispatcher (Megatron-Core moe_token_dispatcher_type): alltoall, allgather, or flex (DeepEP's "
              "kernels: GPUs with DeepEP installed only)", default_note="alltoall with ep > 1, allgather otherwise",
        backends=MEGATRON)
    moe_grouped_gemm: StrictBool | None = option(
        None, "MoE: run a rank's experts as one grouped GEMM (Transformer Engine's GroupedLinear)",
        default_note="true with Transformer Engine modules, false with local ones", backends=MEGATRON)
    moe_capacity_factor: float | None = option(
        None, "MoE: each expert takes at most this multiple of its balanced share of tokens and drops the rest "
              "(Megatron-Core moe_expert_capacity_factor)", default_note="dropless", metavar="F", backends=MEGATRON)
    moe_load_balancing: MoeBalancing | None = option(
        None, "MoE router load balancing: aux_loss (GShard's auxiliary loss) or expert_bias (DeepSeek-V3's "
              "aux-loss-free score bias; sigmoid routers)", default_note="expert_bias for models routed with one "
                                                                          "(DeepSeek-V3), aux_loss otherwise",
        backends=MEGATRON)
    overlap_moe_expert_parallel_comm: StrictBool = option(
        False, "MoE: hide the expert-parallel all-to-alls behind another micro-batch's compute (Megatron-Core's "
               "combined 1F1B schedule, TransformerConfig.overlap_moe_expert_parallel_comm; Megatron-Bridge's "
               "moe_a2a_overlap). Needs ep > 1, the alltoall or flex dispatcher, no full recompute, vpp > 1 with "
               "pp > 1, and at most one MTP layer", backends=MEGATRON)
    zero: ZeroStage | None = option(None, "DeepSpeed ZeRO stage", default_note="1 with deepspeed, 0 otherwise",
                                    backends=DEEPSPEED, off=0)
    dp_shard: PositiveInt | None = option(
        None, "FSDP2: ranks each parameter is sharded over (Accelerate's ParallelismConfig dp_shard_size)",
        default_note="every data-parallel rank of a replica (dp / dp_replicate) with fsdp", backends=FSDP)
    dp_replicate: PositiveInt | None = option(
        None, "FSDP2: replicas of the sharded model (HSDP when > 1; dp_replicate x dp_shard x tp = GPUs)",
        default_note="1 with fsdp", backends=FSDP)
    reshard_after_forward: StrictBool | None = option(
        None, "FSDP2: free each layer group's gathered parameters after forward (FULL_SHARD-like) or keep them "
              "until backward (false: SHARD_GRAD_OP-like, no second all-gather)", default_note="true with fsdp",
        backends=FSDP)
    distributed_optimizer: StrictBool = option(False, "Megatron-Core distributed optimizer", backends=MEGATRON)
    sequence_parallel: StrictBool = option(False, "Megatron-Core sequence parallelism (needs tp > 1)",
                                           backends=MEGATRON)
    micro_batch: PositiveInt = option(1, "sequences per GPU per forward pass")
    global_batch: PositiveInt | None = option(None, "sequences per optimizer step", recipe="training.global_batch",
                                              default_note="micro-batch x dp, no gradient accumulation")
    seq_len: PositiveInt = option(4096, "tokens per sequence", recipe="training.seq_len")
    recompute: Recompute = option("none", "activation recomputation")
    tiled_mlp: StrictBool = option(False, "compute the MLP in sequence tiles (DeepSpeed's TiledMLP), never holding the "
                                          "whole [seq, ffn] tensor", backends=DEEPSPEED + FSDP)
    tiled_loss: StrictBool = option(False, "compute logits and loss in sequence tiles (DeepSpeed's TiledFusedLogitsLoss), "
                                           "never holding the whole [seq, vocab] logits", backends=DEEPSPEED + FSDP)
    # HF Trainer backends: torch.autograd.graph.save_on_cpu around the checkpointed layers (ALST's checkpoint offload);
    # Megatron-Core's cpu_offloading moves whole layers' activations and refuses recomputation
    # (TransformerConfig.__post_init__)
    offload_activations: ActivationOffload = option("none", "keep checkpointed activations in host memory",
                                                    backends=DEEPSPEED + FSDP)
    recompute_modules: tuple[RecomputeModule, ...] | None = option(
        None, "Megatron-Core selective recompute: the modules recomputed", default_note="core_attn",
        metavar="core_attn,mlp,moe_act,...", backends=MEGATRON)
    recompute_num_layers: PositiveInt | None = option(
        None, "Megatron-Core full recompute, block method: the first N layers of every model chunk",
        default_note="every layer", metavar="N", backends=MEGATRON)
    transformer_impl: TransformerImpl | None = option(
        None, "Megatron-Core layer modules: Transformer Engine's fused ones, or its own `local` ones (unfused "
              "attention and SwiGLU: more activation memory)",
        default_note="transformer_engine on GPUs, local in CPU recipes", backends=MEGATRON)
    precision: Precision = option("bf16", "training precision (fp8, fp4: Transformer Engine's GEMMs, everything else "
                                          "bf16)")
    # low-precision GEMMs (Megatron-Core's --fp8-recipe / --fp4-recipe / --fp8-param-gather): spec/quantization.py
    fp8_recipe: Fp8Recipe | None = option(
        None, "with --precision fp8: Transformer Engine's scaling recipe (delayed and tensorwise: one scale per tensor; "
              "blockwise: DeepSeek-V3's 1x128 / 128x128 blocks; mxfp8: Blackwell's 32-element blocks; with fsdp, Accelerate's: delayed and mxfp8 through Transformer "
              "Engine, tensorwise through torchao)",
        default_note="delayed with --precision fp8", backends=MEGATRON + FSDP)
    fp4_recipe: Fp4Recipe | None = option(
        None, "with --precision fp4: Transformer Engine's recipe (nvfp4: Blackwell's 16-element blocks with fp8 "
              "scales)", default_note="nvfp4 with --precision fp4", backends=MEGATRON)
    fp8_param_gather: StrictBool = option(
        False, "keep the GEMM weights themselves in fp8 (no bf16 copy beside the fp8 one) and all-gather them in fp8 "
               "(needs --distributed-optimizer)", backends=MEGATRON)
    grad_reduce_in_bf16: StrictBool = option(
        False, "Megatron-LM's --grad-reduce-in-bf16: accumulate and reduce the gradients in bf16 (2 B/param main-grad "
               "buffers) instead of fp32 (NeMo's and Megatron-Bridge's performance recipes); bf16, fp8 and fp4 "
               "training only", backends=MEGATRON)
    attention: Attention = option(
        "sdpa", "the HF models' attention kernels (transformers' attn_implementation): sdpa keeps no s x s matrix, "
                "eager keeps the probabilities, flash_attention_2 (flash-attn, CUDA) keeps packed documents apart in "
                "a variable-length kernel", default_note="sdpa; eager for models with attention sinks (GPT-OSS)",
        backends=DEEPSPEED + FSDP)
    optimizer: Optimizer = option("adamw", "optimizer")
    offload_optimizer: Offload = option("none", "DeepSpeed ZeRO optimizer-state offload", backends=DEEPSPEED)
    offload_params: Offload = option("none", "DeepSpeed ZeRO-3 parameter offload; with fsdp, cpu is FSDP2's "
                                             "CPUOffloadPolicy (parameters, gradients and optimizer states on the "
                                             "host)", backends=DEEPSPEED + FSDP)
    nvme_path: str | None = option(None, "local NVMe directory for nvme offload", metavar="DIR", backends=DEEPSPEED)
    first_stage_layers: PositiveInt | None = option(
        None, "Megatron-Core uneven pipeline split: layers of the first stage (the rest split evenly)",
        backends=MEGATRON)
    last_stage_layers: PositiveInt | None = option(
        None, "Megatron-Core uneven pipeline split: layers of the last stage", backends=MEGATRON)
    pipeline_model_parallel_layout: str | None = option(
        None, "Megatron-Core pipeline layout: the layers of each stage, virtual stage by virtual stage then rank, "
              "separated by | (E embedding, t decoder layer, m MTP layer, L loss; x*n and (...)*n repeat), e.g. "
              "DeepSeek-V3 at PP 16 x VPP 2: Et|(tt|)*30mL", default_note="the even or --first/last-stage-layers split",
        metavar="LAYOUT", backends=MEGATRON)
    account_for_embedding_in_pipeline_split: StrictBool = option(
        False, "Megatron-Core: the embedding counts as one layer of the first pipeline stage (Llama 3 405B's split)",
        backends=MEGATRON)
    account_for_loss_in_pipeline_split: StrictBool = option(
        False, "Megatron-Core: the output layer and loss count as one layer of the last pipeline stage",
        backends=MEGATRON)

    @field_validator("recompute_modules", mode="before")
    @classmethod
    def _comma_list(cls, value):
        """`core_attn,mlp`, as the flag gives it, is the list [core_attn, mlp]."""
        return [part for part in value.split(",") if part] if isinstance(value, str) else value


OPTION_NAMES = tuple(PlanOptions.model_fields)
RECOMPUTE_MODULES: tuple[str, ...] = get_args(RecomputeModule)
TRANSFORMER_IMPLS: tuple[str, ...] = get_args(TransformerImpl)
# the options that say how activations are kept: the plan search tries them within one layout
# (toolkit/planner/search.py), and no model-state term reads them (toolkit/estimate/memory.py MODEL_STATE_BLIND)
RECOMPUTE_KEYS = ("recompute", "recompute_modules", "recompute_num_layers", "tiled_mlp", "tiled_loss",
                  "offload_activations")


def field_extra(info: FieldInfo, key: str) -> Any:
    return (info.json_schema_extra or {}).get(key) if isinstance(info.json_schema_extra, dict) else None


def recipe_key(name: str) -> str:
    """The dotted recipe key of a plan option: `plan.zero`, or `training.seq_len` for sizes kept elsewhere."""
    return field_extra(PlanOptions.model_fields[name], "recipe") or f"plan.{name}"


def flag(name: str) -> str:
    """The command-line flag of a plan option: `--micro-batch` for micro_batch."""
    return "--" + name.replace("_", "-")


def option_name(key: str) -> str | None:
    """The option a flag (`--micro-batch`) or recipe key (`plan.micro_batch`, `training.seq_len`) names, if any."""
    if key.startswith("--"):
        name = key[2:].replace("-", "_")
        return name if name in PlanOptions.model_fields else None
    return next((name for name in OPTION_NAMES if recipe_key(name) == key), None)


def choices(name: str) -> tuple:
    """The values a Literal option (or a tuple of them) accepts: `choices("precision")`."""
    annotation = PlanOptions.model_fields[name].annotation
    pending = [annotation]
    while pending:  # Literal[...], or one inside Optional / tuple[...]
        current = pending.pop(0)
        if get_origin(current) is Literal:
            return get_args(current)
        pending += get_args(current)
    raise KeyError(f"plan option {name} has no fixed choices")


# read once: every plan the search resolves asks these of every option (spec/plan.py _check_own_options)
_BACKENDS = {name: field_extra(info, "backends") or NAMES for name, info in PlanOptions.model_fields.items()}
_UNUSED = {name: (info.default, field_extra(info, "off")) for name, info in PlanOptions.model_fields.items()}


def option_backends(name: str) -> tuple[str, ...]:
    """The backends a plan option means something to (`zero`: deepspeed; `dp_shard`: fsdp; `tp`: all of them)."""
    return _BACKENDS[name]


def for_backend(name: str, backend: str) -> bool:
    """Whether a plan option means something to a backend (`zero` only to deepspeed, `dp_shard` only to fsdp)."""
    return backend in _BACKENDS[name]


def default(name: str) -> Any:
    return PlanOptions.model_fields[name].default


def is_unused(name: str, value: Any) -> bool:
    """Whether a plan option's value leaves it unused: its default, its declared `off` value, or nothing."""
    return value is None or value == () or value in _UNUSED[name]


def default_text(name: str) -> str:
    """The default as help texts show it: the value, or the note of a derived default."""
    info = PlanOptions.model_fields[name]
    note = field_extra(info, "default_note")
    if note is not None:
        return note
    if isinstance(info.default, bool):
        return "on" if info.default else "off"
    return "unset" if info.default is None else str(info.default)
