"""A parallel training plan and the divisibility rules that make it valid, resolved from a model and a GPU count."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict

from toolkit.errors import UserInputError
from toolkit.estimate.pipeline import PipelineSplit
from toolkit.spec.model import ModelSpec

Backend = Literal["deepspeed", "megatron"]
Precision = Literal["bf16", "fp16", "fp32", "fp8"]
Offload = Literal["none", "cpu", "nvme"]
# Megatron-Core's selective-recompute modules this toolkit models (TransformerConfig.recompute_modules)
RecomputeModule = Literal["core_attn", "mlp"]
RECOMPUTE_MODULES = get_args(RecomputeModule)
# Megatron-Core layer modules: Transformer Engine's fused ones, or its own `local` ones (unfused attention and SwiGLU)
TransformerImpl = Literal["transformer_engine", "local"]
TRANSFORMER_IMPLS = get_args(TransformerImpl)

# Bytes of one parameter / activation element stored in each training precision (fp8 keeps bf16 weights and
# activations; Transformer Engine adds fp8 weight copies, counted in memory.py).
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}

SPLIT_OPTIONS = ("first_stage_layers", "last_stage_layers", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split")

DEFAULTS = dict(
    gpus_per_node=8,
    gpu="h100-80gb",
    backend="deepspeed",
    tp=1,
    pp=1,
    vpp=1,
    cp=1,
    ep=1,
    zero=None,  # 1 for deepspeed (the usual starting point), 0 for megatron (it uses --distributed-optimizer)
    micro_batch=1,
    global_batch=None,  # micro_batch * dp (no gradient accumulation)
    seq_len=4096,
    recompute="none",
    precision="bf16",
    attention="sdpa",
    optimizer="adamw",
    offload_optimizer="none",
    offload_params="none",
)


class Plan(BaseModel):
    """A resolved plan: every size explicit, dp and grad_accum derived from the GPU count and batch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Backend
    gpus: int
    gpus_per_node: int
    dp: int
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    zero: int
    distributed_optimizer: bool
    sequence_parallel: bool
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    recompute: Literal["none", "selective", "full"]
    # selective: Megatron-Core's recompute_modules (its default: core attention); () otherwise
    recompute_modules: tuple[RecomputeModule, ...] = ()
    # full: Megatron-Core's block method, the first N layers of every model chunk recomputed; None: every layer
    recompute_num_layers: int | None = None
    transformer_impl: TransformerImpl | None = None  # megatron only; None for deepspeed (HF modules)
    precision: Precision
    attention: Literal["sdpa", "eager"]
    optimizer: Literal["adamw", "adamw8bit", "sgd"]
    offload_optimizer: Offload
    offload_params: Offload
    nvme_path: str | None = None
    first_stage_layers: int | None = None  # uneven pipeline split (Megatron num_layers_in_first_pipeline_stage)
    last_stage_layers: int | None = None
    # Megatron-Core counts the embedding / the loss as one layer of the first / last stage (Llama 3 405B's layout)
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def expert_dp(self) -> int:
        """Data-parallel replicas of each expert (Megatron's expert-data-parallel group, with expert TP = TP)."""
        return self.dp * self.cp // self.ep

    def as_dict(self) -> dict:
        return self.model_dump(mode="json")  # JSON types (recompute_modules a list), as plan.json stores them


def _positive(flag: str, value: int) -> None:
    if value is None or value < 1:
        raise UserInputError(flag, f"must be a positive integer, got {value}")


def resolve_plan(model: ModelSpec, gpus: int, **options) -> Plan:
    """Fill defaults, derive dp and gradient accumulation, and reject plans the libraries would reject."""
    unknown = set(options) - set(DEFAULTS) - {
        "distributed_optimizer", "sequence_parallel", "nvme_path", "recompute_modules", "recompute_num_layers",
        "transformer_impl", *SPLIT_OPTIONS
    }
    if unknown:
        raise TypeError(f"unknown plan options: {sorted(unknown)}")
    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    backend = o["backend"]
    _positive("--gpus", gpus)
    for key in ("gpus_per_node", "tp", "pp", "vpp", "cp", "ep", "micro_batch", "seq_len"):
        _positive("--" + key.replace("_", "-"), o[key])
    tp, pp, vpp, cp, ep = o["tp"], o["pp"], o["vpp"], o["cp"], o["ep"]
    zero = o["zero"] if o["zero"] is not None else (1 if backend == "deepspeed" else 0)
    dist_opt = bool(o.get("distributed_optimizer", False))
    seq_par = bool(o.get("sequence_parallel", False))

    if model.num_attention_heads % tp or model.num_kv_heads % tp:
        raise UserInputError(
            "--tp",
            f"{tp} must divide attention heads ({model.num_attention_heads}) and kv heads ({model.num_kv_heads}); "
            f"valid: {', '.join(str(d) for d in _divisors(model.num_kv_heads))}",
        )
    if vpp > 1 and pp == 1:
        raise UserInputError("--vpp", "virtual pipeline stages need --pp > 1")
    split = PipelineSplit(model.num_layers, pp, vpp, o.get("first_stage_layers"), o.get("last_stage_layers"),
                          bool(o.get("account_for_embedding_in_pipeline_split")),
                          bool(o.get("account_for_loss_in_pipeline_split")))
    custom_split = split.uneven or split.embedding_in_split or split.loss_in_split
    if custom_split and backend != "megatron":
        raise UserInputError("--first-stage-layers", "an uneven pipeline split is a Megatron-Core option")
    if problem := split.problem():
        raise UserInputError(*problem)
    if gpus % (tp * pp * cp):
        raise UserInputError("--gpus", f"{gpus} is not divisible by tp x pp x cp = {tp * pp * cp}")
    dp = gpus // (tp * pp * cp)
    if ep > 1:
        if not model.is_moe:
            raise UserInputError("--ep", f"expert parallelism needs an MoE model; {model.name} has no experts")
        if model.num_experts % ep:
            raise UserInputError("--ep", f"{ep} must divide the {model.num_experts} experts")
        if (dp * cp) % ep:
            raise UserInputError("--ep", f"{ep} must divide dp x cp = {dp * cp}")
    if cp > 1 and o["seq_len"] % (2 * cp):
        raise UserInputError("--seq-len", f"{o['seq_len']} must be divisible by 2 x cp = {2 * cp}")
    if not 0 <= zero <= 3:
        raise UserInputError("--zero", f"stage must be 0, 1, 2 or 3, got {zero}")

    if backend == "deepspeed":
        _check_deepspeed(zero, tp, pp, vpp, cp, dist_opt, seq_par, o)
    else:
        _check_megatron(zero, tp, seq_par, o)

    modules, num_layers = _recompute_options(o, backend)
    micro = o["micro_batch"]
    global_batch = o["global_batch"] if o["global_batch"] is not None else micro * dp
    _positive("--global-batch", global_batch)
    if global_batch % (micro * dp):
        raise UserInputError(
            "--global-batch",
            f"{global_batch} is not divisible by micro-batch x dp = {micro} x {dp}; "
            f"try {micro * dp * max(1, round(global_batch / (micro * dp)))}",
        )
    if vpp > 1 and (global_batch // (micro * dp)) % pp:
        # forward_backward_pipelining_with_interleaving runs micro-batches in groups of pp (schedules.py)
        raise UserInputError(
            "--global-batch", f"the interleaved schedule (--vpp {vpp}) needs micro-batches per step "
                              f"({global_batch // (micro * dp)}) to be a multiple of --pp {pp}",
        )
    return Plan(
        backend=backend,
        gpus=gpus,
        gpus_per_node=o["gpus_per_node"],
        dp=dp,
        tp=tp,
        pp=pp,
        vpp=vpp,
        cp=cp,
        ep=ep,
        zero=zero,
        distributed_optimizer=dist_opt,
        sequence_parallel=seq_par,
        micro_batch=micro,
        grad_accum=global_batch // (micro * dp),
        global_batch=global_batch,
        seq_len=o["seq_len"],
        recompute=o["recompute"],
        recompute_modules=modules,
        recompute_num_layers=num_layers,
        transformer_impl=(o.get("transformer_impl") or "transformer_engine") if backend == "megatron" else None,
        precision=o["precision"],
        attention=o["attention"],
        optimizer=o["optimizer"],
        offload_optimizer=o["offload_optimizer"],
        offload_params=o["offload_params"],
        nvme_path=o.get("nvme_path"),
        first_stage_layers=split.first_stage_layers,
        last_stage_layers=split.last_stage_layers,
        account_for_embedding_in_pipeline_split=split.embedding_in_split,
        account_for_loss_in_pipeline_split=split.loss_in_split,
    )


def _recompute_options(o: dict, backend: str) -> tuple[tuple[str, ...], int | None]:
    """(recompute_modules, recompute_num_layers) as Megatron-Core's TransformerConfig takes them."""
    recompute, modules, num_layers = o["recompute"], o.get("recompute_modules"), o.get("recompute_num_layers")
    if modules is not None and len(modules) == 0 and recompute != "selective":  # () is Plan's "not selective"
        modules = None
    if modules is not None:
        if isinstance(modules, str):
            modules = [m for m in modules.split(",") if m]
        if not isinstance(modules, (list, tuple)):
            raise UserInputError("--recompute-modules", f"must be a list of {', '.join(RECOMPUTE_MODULES)}, "
                                                        f"got {modules!r}")
        if recompute != "selective":
            raise UserInputError("--recompute-modules", "applies to --recompute selective only")
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown or not modules:
            raise UserInputError("--recompute-modules", f"got {','.join(unknown) or 'nothing'}; "
                                                        f"valid: a comma list of {', '.join(RECOMPUTE_MODULES)}")
    if num_layers is not None:
        if recompute != "full" or backend != "megatron":
            raise UserInputError("--recompute-num-layers", "applies to --recompute full with --backend megatron "
                                                           "(Megatron-Core's block method)")
        _positive("--recompute-num-layers", num_layers)
    if recompute != "selective":
        return (), num_layers
    return tuple(m for m in RECOMPUTE_MODULES if m in (modules or ("core_attn",))), None


def _check_deepspeed(zero: int, tp: int, pp: int, vpp: int, cp: int, dist_opt: bool, seq_par: bool, o: dict) -> None:
    if pp > 1 and zero >= 2:
        raise UserInputError("--zero", f"ZeRO-{zero} cannot be combined with DeepSpeed pipeline parallelism; use 0 or 1")
    if tp > 1 and zero == 3:
        raise UserInputError("--zero", "DeepSpeed AutoTP training supports ZeRO 0-2; use --zero 2 or --tp 1")
    if vpp > 1:
        raise UserInputError("--vpp", "DeepSpeed's pipeline has no interleaved schedule; use --backend megatron")
    if cp > 1:
        raise UserInputError("--cp", "context parallelism is modelled for --backend megatron only")
    if dist_opt:
        raise UserInputError("--distributed-optimizer", "is a Megatron option; with DeepSpeed use --zero 1")
    if seq_par:
        raise UserInputError("--sequence-parallel", "is a Megatron-Core option; use --backend megatron")
    if o["recompute"] == "selective":
        raise UserInputError("--recompute", "HF models checkpoint whole layers: use none or full with deepspeed")
    if o["precision"] == "fp8":
        raise UserInputError("--precision", "fp8 training is modelled for --backend megatron (Transformer Engine)")
    if o["offload_params"] != "none" and zero != 3:
        raise UserInputError("--offload-params", "parameter offload needs --zero 3")
    if o["offload_optimizer"] != "none" and zero == 0:
        raise UserInputError("--offload-optimizer", "optimizer offload needs --zero 1, 2 or 3")
    if "nvme" in (o["offload_optimizer"], o["offload_params"]) and not o.get("nvme_path"):
        raise UserInputError("--nvme-path", "offload to nvme needs --nvme-path DIR (a local NVMe mount)")
    if o["optimizer"] == "adamw8bit" and zero > 0:
        raise UserInputError("--optimizer", "8-bit AdamW (bitsandbytes) is not a ZeRO-partitionable optimizer; use --zero 0")


TE_MODULES = ("Transformer Engine layer modules (--transformer-impl, or a recipe's megatron.transformer_impl: "
              "transformer_engine)")


def _check_megatron(zero: int, tp: int, seq_par: bool, o: dict) -> None:
    if o.get("transformer_impl") not in (None, *TRANSFORMER_IMPLS):
        raise UserInputError("--transformer-impl", f"got {o['transformer_impl']!r}; valid: {', '.join(TRANSFORMER_IMPLS)}")
    if o.get("transformer_impl") == "local" and o["precision"] == "fp8":
        raise UserInputError("--precision", f"fp8 needs {TE_MODULES}")
    if o.get("transformer_impl") == "local" and o["cp"] > 1:
        raise UserInputError("--cp", f"context parallelism needs {TE_MODULES}")
    if zero:
        raise UserInputError("--zero", "is a DeepSpeed option; with Megatron use --distributed-optimizer")
    if o["offload_optimizer"] != "none" or o["offload_params"] != "none":
        raise UserInputError("--offload-optimizer", "offload is modelled for --backend deepspeed only")
    if seq_par and tp == 1:
        raise UserInputError("--sequence-parallel", "needs --tp > 1")
    if o["optimizer"] == "adamw8bit":
        raise UserInputError("--optimizer", "Megatron-Core supports adamw and sgd")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
