"""The resolved parallel plan and the rules that make it valid, resolved from a model, a GPU count and options.

`Plan` is `PlanOptions` (spec/options.py) with every size explicit and dp and grad_accum derived. Its validator holds
every rule between options, so a Plan built from a dict (plan.json) is checked like one resolved from flags; the
rules that need the model (heads by TP, layers by PP, experts by EP) run when the model is in the validation context.
Each rule names the flag at fault; recipes rename it to their key (spec/recipe.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError, ValidationInfo, model_validator

from toolkit.errors import UserInputError
from toolkit.spec.finetune import FinetuneOptions, check_finetune, finetune_flag
from toolkit.spec.model import ModelSpec
from toolkit.spec.options import (
    OPTION_NAMES,
    RECOMPUTE_MODULES,
    PlanOptions,
    PositiveInt,
    RecomputeModule,
    ZeroStage,
    choices,
    flag,
)
from toolkit.spec.pipeline import PipelineSplit

# Bytes of one parameter / activation element stored in each training precision (fp8 keeps bf16 weights and
# activations; Transformer Engine adds fp8 weight copies, counted in memory.py).
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}

TE_MODULES = ("Transformer Engine layer modules (--transformer-impl, or a recipe's plan.transformer_impl: "
              "transformer_engine)")


class Plan(PlanOptions):
    """A resolved plan: every size explicit, dp and grad_accum derived from the GPU count and batch."""

    gpus: PositiveInt
    dp: PositiveInt
    grad_accum: PositiveInt
    zero: ZeroStage
    global_batch: PositiveInt
    # selective: Megatron-Core's recompute_modules (its default: core attention); () otherwise
    recompute_modules: tuple[RecomputeModule, ...] = ()
    finetune: FinetuneOptions = FinetuneOptions()  # what trains (spec/finetune.py): all of it, or LoRA adapters

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def expert_dp(self) -> int:
        """Data-parallel replicas of each expert (Megatron's expert-data-parallel group, with expert TP = TP)."""
        return self.dp * self.cp // self.ep

    def as_dict(self) -> dict:
        return self.model_dump(mode="json")  # JSON types (recompute_modules a list), as plan.json stores them

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> Plan:
        check_rules(self, (info.context or {}).get("model"))
        return self


def validated(cls: type[BaseModel], data: dict, context: dict | None = None):
    """`cls.model_validate(data)` with the first problem as a UserInputError naming the flag (a rule's own error
    as raised)."""
    try:
        return cls.model_validate(data, context=context)
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, UserInputError):
            raise cause from None
        name = str(err["loc"][0]) if err["loc"] else ""
        raise UserInputError(flag(name) if name else "plan", field_message(err, name)) from None


def field_message(err: dict, name: str) -> str:
    """pydantic's complaint about one option's value, in the toolkit's words."""
    value = err.get("input")
    if err["type"] == "literal_error":
        return f"got {value!r}; valid: {', '.join(str(c) for c in choices(name))}"
    if err["type"] == "greater_than_equal":
        return f"must be a positive integer, got {value!r}"
    if err["type"] in ("int_type", "int_parsing"):
        return f"must be an integer, got {value!r}"
    if err["type"] in ("bool_type", "bool_parsing"):
        return f"must be true or false, got {value!r}"
    if err["type"] == "extra_forbidden":
        return "is not a plan option"
    return err["msg"]


def resolve_plan(model: ModelSpec, gpus: int, finetune: FinetuneOptions | dict | None = None, **options: Any) -> Plan:
    """Fill defaults, derive dp and gradient accumulation, and reject plans the libraries would reject. `finetune`:
    what trains (FinetuneOptions or its fields; default every parameter)."""
    given = {k: v for k, v in options.items() if v is not None}
    unknown = set(given) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"unknown plan options: {sorted(unknown)}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise UserInputError("--gpus", f"must be a positive integer, got {gpus!r}")
    values = validated(PlanOptions, given).model_dump()
    megatron = values["backend"] == "megatron"
    if values["zero"] is None:  # DeepSpeed's usual start; Megatron and FSDP2 shard their own way
        values["zero"] = 1 if values["backend"] == "deepspeed" else 0
    # Megatron-Core layer modules; the HF modules of the other backends have no such choice
    values["transformer_impl"] = (values["transformer_impl"] or "transformer_engine") if megatron else None
    # dp and grad_accum as close as the sizes allow: the rules below say what does not divide
    model_parallel = values["tp"] * values["pp"] * values["cp"]
    dp = max(1, gpus // model_parallel)
    micro = values["micro_batch"]
    global_batch = values["global_batch"] or micro * dp
    values.update(gpus=gpus, dp=dp, global_batch=global_batch, grad_accum=max(1, global_batch // (micro * dp)),
                  recompute_modules=_recompute_modules(values["recompute"], values["recompute_modules"]))
    if values["backend"] == "fsdp":  # one replica (HSDP: each of dp_replicate) shards over all its data ranks
        replicas = values["dp_replicate"] = values["dp_replicate"] or 1
        values["dp_shard"] = values["dp_shard"] or max(1, dp // replicas)
        values["reshard_after_forward"] = values["reshard_after_forward"] in (None, True)
    values["finetune"] = finetune_options(finetune)
    return validated(Plan, values, context={"model": model})


def finetune_options(given: FinetuneOptions | dict | None) -> FinetuneOptions:
    """FinetuneOptions from its fields (a recipe section or flags), with the one-line error naming the flag."""
    if isinstance(given, FinetuneOptions):
        return given
    try:
        return FinetuneOptions.model_validate(given or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "method"
        flag_name = finetune_flag(name) if name in FinetuneOptions.model_fields else "--finetune"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "literal_error":
            message = f"got {err['input']!r}; valid: {err['ctx']['expected']}"
        raise UserInputError(flag_name, message) from None


def _recompute_modules(recompute: str, modules: tuple | None) -> tuple:
    """Megatron-Core's default for selective recompute (core attention), in the canonical order; () for the others."""
    if modules is None:
        return ("core_attn",) if recompute == "selective" else ()
    return tuple(m for m in RECOMPUTE_MODULES if m in modules)


def check_rules(plan: Plan, model: ModelSpec | None) -> None:
    """Every rule between options, in the order a user fixes them; the model's rules only when it is given."""
    p = plan
    if model is not None and (model.num_attention_heads % p.tp or model.num_kv_heads % p.tp):
        raise UserInputError(
            "--tp",
            f"{p.tp} must divide attention heads ({model.num_attention_heads}) and kv heads ({model.num_kv_heads}); "
            f"valid: {', '.join(str(d) for d in divisors(model.num_kv_heads) if model.num_attention_heads % d == 0)}",
        )
    if p.vpp > 1 and p.pp == 1:
        raise UserInputError("--vpp", "virtual pipeline stages need --pp > 1")
    custom_split = (p.first_stage_layers is not None or p.last_stage_layers is not None
                    or p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split)
    if custom_split and p.backend != "megatron":
        raise UserInputError("--first-stage-layers", "an uneven pipeline split is a Megatron-Core option")
    if model is not None and (problem := PipelineSplit.of(model.num_layers, p).problem()):
        raise UserInputError(*problem)
    if p.gpus % p.model_parallel:
        raise UserInputError("--gpus", f"{p.gpus} is not divisible by tp x pp x cp = {p.model_parallel}")
    if p.dp != p.gpus // p.model_parallel:
        raise UserInputError("dp", f"{p.dp} but gpus / (tp x pp x cp) = {p.gpus // p.model_parallel}")
    _check_experts(p, model)
    if p.cp > 1 and p.seq_len % (2 * p.cp):
        raise UserInputError("--seq-len", f"{p.seq_len} must be divisible by 2 x cp = {2 * p.cp}")
    if p.backend != "fsdp":
        _check_not_fsdp(p)
    if p.backend == "deepspeed":
        _check_deepspeed(p)
    elif p.backend == "megatron":
        _check_megatron(p)
    else:
        _check_fsdp(p)
    _check_recompute(p)
    _check_batch(p)
    check_finetune(p, model)


def _check_experts(p: Plan, model: ModelSpec | None) -> None:
    if p.ep == 1:
        return
    if model is not None and not model.is_moe:
        raise UserInputError("--ep", f"expert parallelism needs an MoE model; {model.name} has no experts")
    if model is not None and model.num_experts % p.ep:
        raise UserInputError("--ep", f"{p.ep} must divide the {model.num_experts} experts")
    if (p.dp * p.cp) % p.ep:
        raise UserInputError("--ep", f"{p.ep} must divide dp x cp = {p.dp * p.cp}")


def _check_deepspeed(p: Plan) -> None:
    if p.pp > 1:  # DeepSpeed's pipeline engine trains a PipelineModule in its own loop, which the HF Trainer is not
        raise UserInputError("--pp", "the HF Trainer cannot run DeepSpeed's pipeline engine (it needs a PipelineModule "
                                     "and DeepSpeed's own training loop); use --backend megatron for pipeline "
                                     "parallelism")
    if p.tp > 1:  # launched for real: HF's DeepSpeed config check counts the TP ranks as data-parallel ones
        raise UserInputError("--tp", "DeepSpeed AutoTP does not train through the HF Trainer here (transformers "
                                     "5.23 checks train_batch_size against every rank as data-parallel); use "
                                     "--backend megatron for tensor parallelism")
    if p.vpp > 1:
        raise UserInputError("--vpp", "DeepSpeed's pipeline has no interleaved schedule; use --backend megatron")
    if p.cp > 1:
        raise UserInputError("--cp", "context parallelism is modelled for --backend megatron only")
    if p.distributed_optimizer:
        raise UserInputError("--distributed-optimizer", "is a Megatron option; with DeepSpeed use --zero 1")
    if p.sequence_parallel:
        raise UserInputError("--sequence-parallel", "is a Megatron-Core option; use --backend megatron")
    if p.transformer_impl is not None:
        raise UserInputError("--transformer-impl", "is a Megatron-Core option; DeepSpeed trains the HF modules")
    if p.recompute == "selective":
        raise UserInputError("--recompute", "HF models checkpoint whole layers: use none or full with deepspeed")
    if p.precision == "fp8":
        raise UserInputError("--precision", "fp8 training is modelled for --backend megatron (Transformer Engine)")
    if p.offload_params != "none" and p.zero != 3:
        raise UserInputError("--offload-params", "parameter offload needs --zero 3")
    if p.offload_optimizer != "none" and p.zero == 0:
        raise UserInputError("--offload-optimizer", "optimizer offload needs --zero 1, 2 or 3")
    if "nvme" in (p.offload_optimizer, p.offload_params) and not p.nvme_path:
        raise UserInputError("--nvme-path", "offload to nvme needs --nvme-path DIR (a local NVMe mount)")
    if p.optimizer == "adamw8bit" and p.zero > 0:
        raise UserInputError("--optimizer", "8-bit AdamW (bitsandbytes) is not a ZeRO-partitionable optimizer; use --zero 0")


def _check_megatron(p: Plan) -> None:
    if p.transformer_impl == "local" and p.precision == "fp8":
        raise UserInputError("--precision", f"fp8 needs {TE_MODULES}")
    if p.transformer_impl == "local" and p.cp > 1:
        raise UserInputError("--cp", f"context parallelism needs {TE_MODULES}")
    if p.zero:
        raise UserInputError("--zero", "is a DeepSpeed option; with Megatron use --distributed-optimizer")
    if p.offload_optimizer != "none" or p.offload_params != "none":
        raise UserInputError("--offload-optimizer", "offload is modelled for --backend deepspeed only")
    if p.sequence_parallel and p.tp == 1:
        raise UserInputError("--sequence-parallel", "needs --tp > 1")
    if p.sequence_parallel and p.transformer_impl == "local":  # Megatron-Core's WrappedTorchNorm asserts it
        raise UserInputError("--sequence-parallel", f"needs {TE_MODULES}: the local spec's torch norms do not "
                                                    f"support sequence parallelism")
    if p.optimizer == "adamw8bit":
        raise UserInputError("--optimizer", "Megatron-Core supports adamw and sgd")


FSDP_OPTIONS = ("dp_shard", "dp_replicate", "reshard_after_forward")


def _check_not_fsdp(p: Plan) -> None:
    for name in FSDP_OPTIONS:
        if getattr(p, name) is not None:
            raise UserInputError(flag(name), "is an FSDP2 option; use --backend fsdp")


def _check_fsdp(p: Plan) -> None:
    """FSDP2 through Accelerate and the HF Trainer: fully_shard over dp_shard ranks (HSDP: replicated dp_replicate
    times); nothing of Megatron's or DeepSpeed's."""
    missing = [name for name in FSDP_OPTIONS if getattr(p, name) is None]
    if missing:
        raise UserInputError(flag(missing[0]), "must be set for an fsdp plan")
    if p.zero:
        raise UserInputError("--zero", "is a DeepSpeed option; FSDP2 shards parameters, gradients and optimizer "
                                       "states over --dp-shard")
    for name, why in (("pp", "pipeline parallelism"), ("cp", "context parallelism"), ("ep", "expert parallelism")):
        if getattr(p, name) > 1:
            raise UserInputError(flag(name), f"{why} is not part of the fsdp backend (Accelerate's FSDP2 + HF "
                                             f"Trainer); use --backend megatron")
    for name in ("distributed_optimizer", "sequence_parallel", "transformer_impl"):
        if getattr(p, name) not in (None, False):
            raise UserInputError(flag(name), "is a Megatron-Core option; FSDP2 trains the HF modules")
    if p.recompute == "selective":
        raise UserInputError("--recompute", "FSDP2 checkpoints whole decoder layers: use none or full with fsdp")
    if p.tp > 1:  # Accelerate applies TP only to a model transformers loaded sharded by a TP plan (DistributedConfig)
        raise UserInputError("--tp", "FSDP2 with tensor parallelism needs the model loaded sharded by a TP plan "
                                     "(transformers' DistributedConfig), which the fsdp backend does not do; use "
                                     "--backend megatron for tensor parallelism")
    if p.precision == "fp8":
        raise UserInputError("--precision", "fp8 training is modelled for --backend megatron (Transformer Engine)")
    if p.offload_optimizer != "none":
        raise UserInputError("--offload-optimizer", "FSDP2's CPUOffloadPolicy moves parameters, gradients and "
                                                    "optimizer states together: use --offload-params cpu")
    if p.offload_params == "nvme":
        raise UserInputError("--offload-params", "FSDP2 offloads to cpu memory only; use --offload-params cpu")
    if p.optimizer == "adamw8bit":
        raise UserInputError("--optimizer", "8-bit AdamW over FSDP2's DTensor shards is not modelled; use adamw or sgd")
    if p.dp_replicate * p.dp_shard != p.dp:
        raise UserInputError("--dp-shard", f"dp_replicate x dp_shard = {p.dp_replicate} x {p.dp_shard} must equal the "
                                           f"data-parallel ranks gpus / tp = {p.dp}")
    if p.dp_shard == 1 and p.dp_replicate > 1:  # accelerate/parallelism_config.py: FSDP needs a dp_shard dimension
        raise UserInputError("--dp-replicate", f"{p.dp_replicate} leaves one rank per shard group: FSDP2 has nothing to "
                                               f"shard over (Accelerate refuses dp_shard_size 1 here); lower it so that "
                                               f"--dp-shard is at least 2")


def _check_recompute(p: Plan) -> None:
    """recompute_modules and recompute_num_layers as Megatron-Core's TransformerConfig takes them."""
    if p.recompute_modules and p.recompute != "selective":
        raise UserInputError("--recompute-modules", "applies to --recompute selective only")
    if p.recompute == "selective" and not p.recompute_modules:
        raise UserInputError("--recompute-modules", f"got nothing; valid: a comma list of {', '.join(RECOMPUTE_MODULES)}")
    if p.recompute_num_layers is not None and (p.recompute != "full" or p.backend != "megatron"):
        raise UserInputError("--recompute-num-layers", "applies to --recompute full with --backend megatron "
                                                       "(Megatron-Core's block method)")


def _check_batch(p: Plan) -> None:
    if p.global_batch % (p.micro_batch * p.dp):
        raise UserInputError(
            "--global-batch",
            f"{p.global_batch} is not divisible by micro-batch x dp = {p.micro_batch} x {p.dp}; "
            f"try {p.micro_batch * p.dp * max(1, round(p.global_batch / (p.micro_batch * p.dp)))}",
        )
    if p.grad_accum != p.global_batch // (p.micro_batch * p.dp):
        raise UserInputError("grad_accum", f"{p.grad_accum} but global batch / (micro-batch x dp) = "
                                           f"{p.global_batch // (p.micro_batch * p.dp)}")
    if p.vpp > 1 and p.grad_accum % p.pp:
        # forward_backward_pipelining_with_interleaving runs micro-batches in groups of pp (schedules.py)
        raise UserInputError("--global-batch", f"the interleaved schedule (--vpp {p.vpp}) needs micro-batches per step "
                                               f"({p.grad_accum}) to be a multiple of --pp {p.pp}")


def divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of n in ascending order, at most `limit` (the sizes a parallel axis of n can take)."""
    # no divisor exceeds n: a limit of --gpus-per-node 10**100 must not count to it
    return [d for d in range(1, min(limit or n, n) + 1) if n % d == 0]
