"""The rules of mixture-of-experts plans (spec/plan.py's check_rules runs them): expert parallelism against the
experts, the MoE options as Megatron-Core 0.16.1 takes them, and its parallel folding of the expert mesh
(ETP x EP x EDP x PP over the ranks attention lays TP x CP x DP x PP on). Each refusal names the flag at fault."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from toolkit.errors import UserInputError
from toolkit.numeric import divisors
from toolkit.spec.model import ModelSpec
from toolkit.spec.options import MOE_IMBALANCE_MAX, flag, for_backend

if TYPE_CHECKING:
    from toolkit.spec.plan import Plan


def check_experts(p: Plan, model: ModelSpec | None) -> None:
    if not 1.0 <= p.moe_imbalance <= MOE_IMBALANCE_MAX:  # a ratio to the mean: the estimators cap it at ep
        raise UserInputError("--moe-imbalance", f"must be a ratio between 1.0 (balanced) and {MOE_IMBALANCE_MAX:g}, "
                                                f"got {p.moe_imbalance!r}")
    if p.etp is not None and model is not None and not model.is_moe:
        raise UserInputError("--etp", f"expert tensor parallelism needs an MoE model; {model.name} has no experts")
    if p.ep > 1 and model is not None and not model.is_moe:
        raise UserInputError("--ep", f"expert parallelism needs an MoE model; {model.name} has no experts")
    if model is not None and model.is_moe and model.num_experts % p.ep:
        raise UserInputError("--ep", f"{p.ep} must divide the {model.num_experts} experts")
    _check_moe_options(p, model)
    if for_backend("etp", p.backend):
        if model is not None and model.expert_bias and p.expert_tp > 1:  # TransformerConfig.__post_init__ asserts it
            raise UserInputError("--etp", f"{model.name}'s experts carry biases, which Megatron-Core 0.16.1 takes at "
                                          f"expert tensor-parallel size 1 only; set --etp 1")
        _check_expert_mesh(p, model)
    elif (p.dp * p.cp) % p.ep:  # DeepSpeed's and FSDP2's expert groups split the data-parallel ranks
        raise UserInputError("--ep", f"{p.ep} must divide dp x cp = {p.dp * p.cp}")


MOE_OPTIONS = ("moe_dispatcher", "moe_grouped_gemm", "moe_capacity_factor", "moe_load_balancing")
# recompute modules that exist only in MoE layers, and what else each needs (TransformerConfig.__post_init__)
MOE_RECOMPUTE = ("moe_act", "moe", "shared_experts")


def fill_moe(values: dict, model: ModelSpec) -> None:
    """The MoE options a plan leaves to Megatron-Core's usual choice: all-to-all dispatch across expert-parallel
    ranks (all-gather without), grouped GEMM wherever Transformer Engine's modules run, and the router's own load
    balancing (DeepSeek-V3's score bias where the model has one, else the auxiliary loss)."""
    if values["moe_dispatcher"] is None:
        values["moe_dispatcher"] = "alltoall" if values["ep"] > 1 else "allgather"
    if values["moe_grouped_gemm"] is None:
        values["moe_grouped_gemm"] = values["transformer_impl"] != "local"
    if values["moe_load_balancing"] is None:
        values["moe_load_balancing"] = "expert_bias" if model.moe_router_expert_bias else "aux_loss"


def _check_moe_options(p: Plan, model: ModelSpec | None) -> None:
    """The MoE options as Megatron-Core 0.16.1 takes them (TransformerConfig.__post_init__, the token dispatchers)."""
    if model is not None and not model.is_moe:
        for name in MOE_OPTIONS:
            if getattr(p, name) is not None:
                raise UserInputError(flag(name), f"is an MoE option; {model.name} has no experts")
        for module in set(p.recompute_modules) & set(MOE_RECOMPUTE):
            raise UserInputError("--recompute-modules", f"{module} recomputes MoE layers; {model.name} has no experts")
    if p.moe_capacity_factor is not None and not 0 < p.moe_capacity_factor <= p.ep * 1024:
        raise UserInputError("--moe-capacity-factor", f"must be a positive multiple of an expert's balanced share "
                                                      f"(1.0: exactly its share), got {p.moe_capacity_factor!r}")
    local = p.transformer_impl == "local"
    if p.moe_dispatcher == "flex" and local:
        raise UserInputError("--moe-dispatcher", "flex runs DeepEP's CUDA kernels: not with the local (CPU) layer "
                                                 "modules; use alltoall or allgather")
    if p.moe_dispatcher == "flex" and p.ep * p.expert_tp == 1:  # MoEFlexTokenDispatcher asserts it
        raise UserInputError("--moe-dispatcher", "flex needs ep x etp > 1 (Megatron-Core's flex dispatcher); use "
                                                 "allgather or alltoall")
    if p.moe_grouped_gemm and local:  # the local spec's GroupedMLP needs the CUDA grouped_gemm package
        raise UserInputError("--moe-grouped-gemm", f"needs Transformer Engine's GroupedLinear (GPUs): set "
                                                   f"--transformer-impl transformer_engine, or false")
    if model is not None and model.is_moe and p.moe_load_balancing == "expert_bias" and (
            model.moe_router_score != "sigmoid"):
        raise UserInputError("--moe-load-balancing", f"expert_bias needs a sigmoid router (TransformerConfig); "
                                                     f"{model.name} routes with {model.moe_router_score}: use aux_loss")
    _check_expert_overlap(p, model)
    modules = set(p.recompute_modules)
    if "moe_act" in modules and not p.moe_grouped_gemm:
        raise UserInputError("--recompute-modules", "moe_act is recomputed with grouped GEMM only (TransformerConfig); "
                                                    "set --moe-grouped-gemm true")
    if model is not None and "mla_up_proj" in modules and not model.kv_lora_rank:
        raise UserInputError("--recompute-modules", f"mla_up_proj needs multi-latent attention; {model.name} has none")
    if model is not None and model.is_moe and "shared_experts" in modules and not model.shared_expert_ffn_hidden_size:
        raise UserInputError("--recompute-modules", f"shared_experts: {model.name} has no shared experts")
    if p.precision == "fp8" and modules & {"moe_act", "layernorm"} and p.fp8_recipe in (None, "delayed"):
        raise UserInputError("--recompute-modules", "moe_act and layernorm recompute refuse fp8's delayed scaling "
                                                    "(TransformerConfig); drop them or set --fp8-recipe tensorwise, "
                                                    "blockwise or mxfp8")


def _check_expert_overlap(p: Plan, model: ModelSpec | None) -> None:
    """overlap_moe_expert_parallel_comm as Megatron-Core 0.16.1 takes it (TransformerConfig.__post_init__): expert
    parallelism, the alltoall or flex dispatcher, no full recomputation, a bf16 / fp16 model (fp8 and fp4 run on
    bf16 parameters), interleaving when pipelined, and at most one MTP layer (with one, a pipeline); the combined
    schedule runs its all-to-alls on a CUDA communication stream (pipeline_parallel/utils.py set_streams)."""
    if not p.overlap_moe_expert_parallel_comm:
        return
    key = "--overlap-moe-expert-parallel-comm"
    if model is not None and not model.is_moe:
        raise UserInputError(key, f"is an MoE option; {model.name} has no experts")
    if p.ep == 1:
        raise UserInputError(key, "needs expert parallelism (--ep > 1): there is no all-to-all to hide")
    if p.moe_dispatcher not in ("alltoall", "flex"):
        raise UserInputError(key, f"needs --moe-dispatcher alltoall or flex, got {p.moe_dispatcher}")
    if p.recompute == "full":
        raise UserInputError(key, "refuses full recomputation (TransformerConfig); use --recompute selective or none")
    if p.precision == "fp32":
        raise UserInputError(key, "needs a bf16 or fp16 model (TransformerConfig); set --precision bf16, fp8 or fp4")
    if p.pp > 1 and p.vpp == 1:
        raise UserInputError(key, "with --pp > 1 needs an interleaved schedule (TransformerConfig: "
                                  "virtual_pipeline_model_parallel_size); set --vpp 2 or more")
    if p.transformer_impl == "local":
        raise UserInputError(key, "runs its all-to-alls on a CUDA stream: not with the local (CPU) layer modules")
    if model is not None and model.mtp_layers > 1:
        raise UserInputError(key, f"takes at most one MTP layer (TransformerConfig); {model.name} has "
                                  f"{model.mtp_layers}")
    if model is not None and model.mtp_layers == 1 and p.pp == 1:
        raise UserInputError(key, "with an MTP layer needs a pipeline (TransformerConfig): set --pp 2 or more")


def smallest_world(tp: int, cp: int, pp: int, ep: int, etp: int) -> int:
    """The fewest ranks Megatron-Core's parallel folding lays both meshes over: attention's TP x CP x DP x PP and the
    experts' ETP x EP x EDP x PP share the ranks, so the world is a multiple of PP x lcm(TP x CP, EP x ETP)."""
    return pp * math.lcm(tp * cp, ep * etp)


def _check_expert_mesh(p: Plan, model: ModelSpec | None) -> None:
    """Megatron-Core 0.16.1's parallel folding (parallel_state.initialize_model_parallel): the expert layers run on
    ETP x EP x EDP x PP over the same ranks as attention's TP x CP x DP x PP, so the world must divide by
    ETP x EP x PP as it divides by TP x CP x PP; EP need not divide DP x CP. Expert weights split over ETP
    (megatron.core.utils.divide in the expert MLPs), and biased experts train at ETP 1 only (TransformerConfig:
    "Bias in Moe is only supported when ETP==1")."""
    etp = p.expert_tp
    if p.gpus % (p.pp * p.ep * etp):
        smallest = smallest_world(p.tp, p.cp, p.pp, p.ep, etp)
        valid = [e for e in divisors(p.gpus // p.pp) if (p.gpus // p.pp) % (e * etp) == 0
                 and (model is None or not model.is_moe or model.num_experts % e == 0)]
        stage = p.gpus // p.pp
        etps = [d for d in divisors(stage // p.ep)] if stage % p.ep == 0 else []
        hint = (f"valid --etp at ep {p.ep}: {', '.join(map(str, etps))}" if etps else
                f"valid --ep at etp {etp}: {', '.join(map(str, valid)) or 'none'}")
        raise UserInputError("--etp" if p.etp is not None else "--ep",
                             f"ep x etp x pp = {p.ep} x {etp} x {p.pp} must divide the {p.gpus} GPUs (Megatron-Core's "
                             f"expert mesh ETP x EP x EDP x PP; this layout needs a multiple of pp x lcm(tp x cp, "
                             f"ep x etp) = {smallest}); {hint}" + ("" if p.etp is not None else " (--etp defaults to --tp)"))
    if model is None or not model.is_moe:
        return
    if p.tp > 1 and not p.sequence_parallel:  # MoELayer.forward raises in training without it
        raise UserInputError("--sequence-parallel", "MoE layers with tensor parallelism need sequence parallelism "
                                                    "(Megatron-Core's MoELayer refuses to train without it): add "
                                                    "--sequence-parallel")
    if model.moe_ffn_hidden_size and model.moe_ffn_hidden_size % etp:
        raise UserInputError("--etp", f"{etp} must divide the experts' inner size {model.moe_ffn_hidden_size}; valid: "
                                      f"{', '.join(str(d) for d in divisors(model.moe_ffn_hidden_size, p.gpus))}")
    if model.mlp_bias and etp > 1:
        raise UserInputError("--etp", f"{etp}: Megatron-Core trains biased experts ({model.name}) at expert tensor "
                                      f"parallelism 1 only (TransformerConfig); set --etp 1")
