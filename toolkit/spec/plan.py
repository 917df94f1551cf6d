"""The resolved parallel plan and the rules that make it valid, resolved from a model, a GPU count and options.

`Plan` is `PlanOptions` (spec/options.py) with every size explicit and dp and grad_accum derived. Its validator holds
every rule between options, so a Plan built from a dict (plan.json) is checked like one resolved from flags; the
rules that need the model (heads by TP, layers by PP, experts by EP) run when the model is in the validation context.
Each rule names the flag at fault; recipes rename it to their key (spec/recipe.py).
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ValidationError, ValidationInfo, model_validator

from toolkit.errors import UserInputError
from toolkit.numeric import divisors
from toolkit.spec.backends import backend_of
from toolkit.spec.finetune import FinetuneOptions, check_finetune, finetune_flag
from toolkit.spec.model import ModelSpec
from toolkit.spec.moe_rules import check_experts, fill_moe
from toolkit.spec.options import (
    FUSED_ATTENTION,
    MOE_IMBALANCE_DEFAULT,
    OPTION_NAMES,
    RECOMPUTE_KEYS,
    RECOMPUTE_MODULES,
    SINK_ATTENTION,
    VARIABLE_LENGTH_ATTENTION,
    PlanOptions,
    PositiveInt,
    RecomputeModule,
    ZeroStage,
    choices,
    flag,
    for_backend,
    is_unused,
    option_backends,
)
from toolkit.spec.pipeline import LAYOUT_FLAG, PipelineSplit, expand_layout
from toolkit.spec.quantization import BF16_COMPUTE, DEFAULT_RECIPE, FP4, FP8

# Bytes of one parameter / activation element stored in each training precision (fp8 and fp4 keep bf16 weights and
# activations; what Transformer Engine's recipes add or save in fewer bytes is spec/quantization.py's).
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2, "fp4": 2}
OPTION_SET = frozenset(OPTION_NAMES)
FULL_TRAINING = FinetuneOptions()  # what trains when nothing says: every parameter (frozen, so one value serves all)


class Plan(PlanOptions):
    """A resolved plan: every size explicit, dp and grad_accum derived from the GPU count and batch."""

    gpus: PositiveInt
    dp: PositiveInt
    grad_accum: PositiveInt
    zero: ZeroStage
    global_batch: PositiveInt
    # selective: Megatron-Core's recompute_modules (its default: core attention); () otherwise
    recompute_modules: tuple[RecomputeModule, ...] = ()
    moe_imbalance: float = MOE_IMBALANCE_DEFAULT  # resolved: the plan's, or the default (spec/options.py)
    nvlink_domain: PositiveInt  # resolved: the plan's, the GPU's (spec/cluster.py topology_defaults), else the node
    finetune: FinetuneOptions = FULL_TRAINING  # what trains (spec/finetune.py): all of it, or LoRA adapters

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp * self.sp

    @property
    def sequence_split(self) -> int:
        """Ranks one sequence is split over: context-parallel (cp) or Ulysses (sp) ranks; each holds 1/this of it."""
        return self.cp * self.sp

    @property
    def data_ranks(self) -> int:
        """Ranks that hold the same model states: data-parallel x sequence-split ones (ZeRO over DeepSpeed's
        sequence-data-parallel group, FSDP2 over Accelerate's dp_shard_cp mesh and Megatron-Core's distributed optimizer
        over dp x cp all shard over them)."""
        return self.dp * self.sequence_split

    @property
    def expert_tp(self) -> int:
        """Tensor-parallel size of the expert layers: --etp under Megatron-Core's parallel folding, else --tp."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Data-parallel replicas of each expert (Megatron's expert-data-parallel group): the ranks of one pipeline
        stage over EP x ETP (parallel folding: the expert layers' mesh is ETP x EP x EDP x PP)."""
        return self.gpus // (self.pp * self.ep * self.expert_tp)

    def as_dict(self) -> dict:
        return self.model_dump(mode="json")  # JSON types (recompute_modules a list), as plan.json stores them

    @model_validator(mode="before")
    @classmethod
    def _node_domain(cls, data: Any) -> Any:
        """A plan that names no NVLink domain (plan.json files written before it existed) has its node as one."""
        if isinstance(data, dict) and data.get("nvlink_domain") is None:
            return {**data, "nvlink_domain": data.get("gpus_per_node", PlanOptions.model_fields["gpus_per_node"].default)}
        return data

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
    unknown = given.keys() - OPTION_SET
    if unknown:
        raise TypeError(f"unknown plan options: {sorted(unknown)}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise UserInputError("--gpus", f"must be a positive integer, got {gpus!r}")
    values = dict(validated(PlanOptions, given).__dict__)  # flat values: model_dump's dict, without its cost
    backend = backend_of(values["backend"])
    if values["zero"] is None:  # DeepSpeed's usual start; Megatron and FSDP2 shard their own way
        values["zero"] = backend.default_zero
    # dp and grad_accum as close as the sizes allow: the rules below say what does not divide
    model_parallel = values["tp"] * values["pp"] * values["cp"] * values["sp"]
    dp = max(1, gpus // model_parallel)
    micro = values["micro_batch"]
    global_batch, grad_accum = _batch(values["global_batch"], micro, dp)
    if values["pipeline_model_parallel_layout"] is not None:  # stored expanded, as megatron.yaml states it
        _resolve_layout(values, "vpp" in given)
    if values["etp"] == values["tp"]:  # no folding: stored unset, as Megatron-Core defaults it (expert_tp)
        values["etp"] = None
    if values["moe_imbalance"] is None:
        values["moe_imbalance"] = MOE_IMBALANCE_DEFAULT
    for precision, recipe in ((FP8, "fp8_recipe"), (FP4, "fp4_recipe")):  # Megatron-Core's default recipe
        if values["precision"] == precision and values[recipe] is None:
            values[recipe] = DEFAULT_RECIPE[precision]
    values.update(gpus=gpus, dp=dp, global_batch=global_batch, grad_accum=grad_accum,
                  recompute_modules=_recompute_modules(values["recompute"], values["recompute_modules"]))
    backend.rules.fill(values)  # what this backend derives (FSDP2's shard groups, Megatron's layer modules)
    if model.attention_sinks and "attention" not in given and for_backend("attention", values["backend"]):
        values["attention"] = SINK_ATTENTION[0]  # transformers' own default where sdpa cannot run (GPT-OSS: eager)
    if model.is_moe and for_backend("moe_dispatcher", values["backend"]):
        fill_moe(values, model)
    values["finetune"] = finetune_options(finetune)
    return validated(Plan, values, context={"model": model})


def with_block_recompute(plan: Plan, model: ModelSpec, layers: int) -> Plan:
    """`plan` (resolved for `model`) with Megatron-Core's block method over the first `layers` layers of every chunk:
    what resolve_plan gives with recompute_num_layers=layers added to the plan's options, for less (the plan search
    bisects it). Nothing resolve_plan fills or derives reads recompute_num_layers, so only it changes; every rule
    between options runs again (tests/unit/test_search_equivalence.py compares the two)."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise UserInputError("--recompute-num-layers", f"must be a positive integer, got {layers!r}")
    return _checked_copy(plan, model, {"recompute_num_layers": layers})


def with_recompute(plan: Plan, model: ModelSpec, settings: dict, micro_batch: int | None = None,
                   global_batch_given: bool = True) -> Plan:
    """`plan` (resolved for `model`) with its recompute options (RECOMPUTE_KEYS) replaced by `settings` (the others
    at their defaults), and at `micro_batch` where given: what resolve_plan gives for the plan's options with those
    instead, for less (the plan search tries several of them on each layout). resolve_plan derives nothing from them
    but recompute_modules (from recompute and the modules given) and, from the micro-batch, the global batch where
    none was given (`global_batch_given` False) and gradient accumulation, each below as there; so only they change.
    They are validated as options, and every rule between options runs again (tests/unit/test_search_equivalence.py
    compares the two)."""
    unknown = settings.keys() - set(RECOMPUTE_KEYS)
    if unknown:
        raise TypeError(f"not recompute options: {sorted(unknown)}")
    given = {k: v for k, v in settings.items() if v is not None}
    if micro_batch is not None:
        given["micro_batch"] = micro_batch
    options = validated(PlanOptions, given)
    update = {k: getattr(options, k) for k in RECOMPUTE_KEYS}
    update["recompute_modules"] = _recompute_modules(update["recompute"], update["recompute_modules"])
    if micro_batch is not None:
        micro = options.micro_batch
        global_batch, grad_accum = _batch(plan.global_batch if global_batch_given else None, micro, plan.dp)
        update.update(micro_batch=micro, global_batch=global_batch, grad_accum=grad_accum)
    return _checked_copy(plan, model, update)


def _batch(global_batch: int | None, micro: int, dp: int) -> tuple[int, int]:
    """(global batch, gradient accumulation): the one given, else one micro-batch per data-parallel rank; and as
    many micro-batches per step as the sizes allow (the rules say what does not divide)."""
    global_batch = global_batch or micro * dp
    return global_batch, max(1, global_batch // (micro * dp))


def _checked_copy(plan: Plan, model: ModelSpec, update: dict) -> Plan:
    """`plan` with `update`'s fields, each already of its field's type, and every rule between options checked."""
    changed = plan.model_copy(update=update)
    check_rules(changed, model)
    return changed


def _resolve_layout(values: dict, vpp_given: bool) -> None:
    """A pipeline layout in its expanded form, and the virtual stages it implies unless --vpp says (the rule below
    then compares them): Megatron-LM's validate_args derives the interleaving from the layout the same way."""
    try:
        layout = expand_layout(values["pipeline_model_parallel_layout"])
    except ValueError as exc:
        raise UserInputError(LAYOUT_FLAG, str(exc)) from None
    values["pipeline_model_parallel_layout"] = layout
    stages = layout.count("|") + 1
    if not vpp_given and stages % values["pp"] == 0:
        values["vpp"] = stages // values["pp"]


def finetune_options(given: FinetuneOptions | dict | None) -> FinetuneOptions:
    """FinetuneOptions from its fields (a recipe section or flags), with the one-line error naming the flag."""
    if isinstance(given, FinetuneOptions):
        return given
    if not given:  # every parameter trains: one frozen value for every plan
        return FULL_TRAINING
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
    if model is not None and (problem := PipelineSplit.of(model.num_layers, p).problem(model.mtp_layers)):
        raise UserInputError(*problem)
    check_nvlink_domain(p)
    sizes = "tp x pp x cp" + (" x sp" if p.sp > 1 else "")
    if p.gpus % p.model_parallel:
        raise UserInputError("--gpus", f"{p.gpus} is not divisible by {sizes} = {p.model_parallel}")
    if p.dp != p.gpus // p.model_parallel:
        raise UserInputError("dp", f"{p.dp} but gpus / ({sizes}) = {p.gpus // p.model_parallel}")
    check_experts(p, model)
    check_sequence_split(p, model)
    rules = backend_of(p).rules
    rules.check(p)
    _check_own_options(p, rules.FOREIGN)
    _check_recompute(p)
    _check_precision(p)
    _check_attention(p, model)
    _check_batch(p)
    check_finetune(p, model)


def check_nvlink_domain(p: Plan) -> None:
    """The NVLink domain is whole nodes: every fabric this toolkit models joins all GPUs of a node (NVSwitch baseboards,
    MI300X/MI355X's fully connected Infinity Fabric, PCIe inside a server) and NVL72 racks join whole 4-GPU trays
    through their NVLink Switch trays, so a domain smaller than the node, or one splitting a node, names no hardware.
    It may exceed the job (a job of 16 GPUs inside one NVL72 rack)."""
    if p.nvlink_domain % p.gpus_per_node:
        valid = ", ".join(str(p.gpus_per_node * n) for n in (1, 2, 9, 18))
        raise UserInputError("--nvlink-domain", f"{p.nvlink_domain} must be a multiple of --gpus-per-node "
                                                f"{p.gpus_per_node} (the domain is whole nodes), e.g. {valid}")


def _check_own_options(p: Plan, foreign: dict[str, str]) -> None:
    """An option that belongs to other backends (its `backends` in spec/options.py) is refused when set, in the
    words of this backend's rules where it has some (`FOREIGN`)."""
    for name in _foreign_options(p.backend):
        value = getattr(p, name)
        if is_unused(name, value):
            continue
        if name not in foreign:
            owner = backend_of(option_backends(name)[0])
            raise UserInputError(flag(name), f"is {owner.article} {owner.label} option; use --backend {owner.name}")
        raise UserInputError(flag(name), foreign[name])


@functools.cache
def _foreign_options(backend: str) -> tuple[str, ...]:
    """The plan options that mean nothing to a backend, in declaration order (asked of every plan resolved)."""
    return tuple(name for name in OPTION_NAMES if not for_backend(name, backend))


def check_sequence_split(p: Plan, model: ModelSpec | None) -> None:
    """Context parallelism (Megatron-Core, torch's through Accelerate) and Ulysses (DeepSpeed's UlyssesSPAttentionHF)
    as the libraries assert them."""
    if p.cp > 1 and p.seq_len % (2 * p.cp):  # both load-balance causal attention over 2 x cp chunks
        raise UserInputError("--seq-len", f"{p.seq_len} must be divisible by 2 x cp = {2 * p.cp}")
    if p.sp == 1:
        return
    if p.cp > 1:  # accelerate/parallelism_config.py: "CP and SP are mutually exclusive"
        raise UserInputError("--sp", "Ulysses (--sp) and context parallelism (--cp) are mutually exclusive; set one to 1")
    heads, kv = (model.num_attention_heads, model.num_kv_heads) if model is not None else (None, None)
    if heads is not None and heads % p.sp:  # deepspeed/runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF
        raise UserInputError("--sp", f"{p.sp} must divide the attention heads ({heads}); valid: "
                                     f"{', '.join(str(d) for d in divisors(heads) if d > 1 and (kv % d == 0 or d % kv == 0))}")
    if kv is not None and kv % p.sp and p.sp % kv:
        raise UserInputError("--sp", f"{p.sp} must divide the kv heads ({kv}) or be a multiple of them")
    if p.seq_len % p.sp:  # UlyssesSPDataLoaderAdapter: "batch's seqlen isn't divisible by sp-size"
        raise UserInputError("--seq-len", f"{p.seq_len} must be divisible by sp = {p.sp}")
    if p.attention not in FUSED_ATTENTION:  # register_with_transformers refuses eager (it needs a 4D mask, which
        # Ulysses drops); flash attention and sdpa it runs
        raise UserInputError("--attention", f"Ulysses (--sp) runs {' or '.join(FUSED_ATTENTION)}; {p.attention} needs "
                                            f"the whole 4D mask")


def _check_recompute(p: Plan) -> None:
    """recompute_modules and recompute_num_layers as Megatron-Core's TransformerConfig takes them."""
    if p.recompute_modules and p.recompute != "selective":
        raise UserInputError("--recompute-modules", "applies to --recompute selective only")
    if p.recompute == "selective" and not p.recompute_modules:
        raise UserInputError("--recompute-modules", f"got nothing; valid: a comma list of {', '.join(RECOMPUTE_MODULES)}")
    if p.offload_activations != "none" and p.recompute != "full":
        raise UserInputError("--offload-activations", "moves the checkpointed layer inputs to the host: it needs "
                                                      "--recompute full")
    if p.recompute_num_layers is not None and p.recompute != "full":  # a Megatron-Core option (spec/options.py)
        raise UserInputError("--recompute-num-layers", "applies to --recompute full with --backend megatron "
                                                       "(Megatron-Core's block method)")


def _check_precision(p: Plan) -> None:
    """The recipe options belong to their precision (Megatron-Core's TransformerConfig: "fp8_param must be used
    together with fp8 mode"); which GPUs run them is spec/quantization.py check_on_gpu."""
    for precision, name in ((FP8, "fp8_recipe"), (FP4, "fp4_recipe")):
        if getattr(p, name) is not None and p.precision != precision:
            raise UserInputError(flag(name), f"applies to --precision {precision}, not {p.precision}")
    if p.fp8_param_gather and p.precision != FP8:
        raise UserInputError("--fp8-param-gather", f"keeps the weights in fp8: it needs --precision fp8, not "
                                                   f"{p.precision}")
    if p.grad_reduce_in_bf16 and p.precision not in BF16_COMPUTE:  # Megatron-LM applies it under --bf16 only
        raise UserInputError("--grad-reduce-in-bf16", f"reduces bf16 gradients: it needs --precision bf16, fp8 or "
                                                      f"fp4, not {p.precision}")


def _check_attention(p: Plan, model: ModelSpec | None) -> None:
    """flash-attn computes in 16 bits only ("FlashAttention only supports fp16 and bf16 data type"): with fp32
    training transformers hands it the fp32 projections (no autocast to cast them down). A model with attention
    sinks (GPT-OSS) has no sdpa path in transformers (SINK_ATTENTION)."""
    if (model is not None and model.attention_sinks and for_backend("attention", p.backend)
            and p.attention not in SINK_ATTENTION):
        raise UserInputError("--attention", f"{p.attention}: transformers runs {model.name}'s attention sinks with "
                                            f"{' or '.join(SINK_ATTENTION)} only; valid: {', '.join(SINK_ATTENTION)}")
    if p.attention in VARIABLE_LENGTH_ATTENTION and p.precision == "fp32":
        raise UserInputError("--attention", f"{p.attention} computes in bf16 or fp16 only; use --precision bf16 or "
                                            f"fp16, or --attention sdpa with fp32")


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
