"""What `dmt estimate --explain` says of DeepSpeed's own terms: ZeRO's partitions, its gradients and ZeRO-Offload.

Each function answers one question toolkit/estimate/explain.py asks every backend; None: the common sentence."""

from __future__ import annotations

from toolkit.estimate.explain import experts_sharding
from toolkit.spec.plan import Plan


def one_replica(plan: Plan) -> dict:
    """Options beyond dp = 1 that put the plan on one data-parallel replica: none."""
    return {}


def sharding(plan: Plan) -> str:
    return f"ZeRO-{plan.zero} over dp x sp = {plan.data_ranks}{experts_sharding(plan)}" if plan.zero else "none (ZeRO-0)"


def weights(plan: Plan) -> tuple[str | None, str | None]:
    """(what the weights are, why they differ from the rule of thumb)."""
    if plan.zero != 3:
        return None, None
    if plan.offload_params != "none":
        return None, f"ZeRO-3 parameter offload keeps them in {plan.offload_params} memory, not on the GPU"
    return None, f"ZeRO-3 keeps 1/{plan.data_ranks} of the parameters on each GPU and gathers the rest layer by layer"


def gradients(plan: Plan) -> tuple[str, str]:
    """(the rule, why it differs from 16-bit gradients on every GPU)."""
    if plan.zero == 0:
        fp32 = plan.precision == "bf16"
        rule = ("fp32 gradients: DeepSpeed's BF16_Optimizer accumulates into fp32 at ZeRO-0" if fp32
                else f"gradients in the weights' dtype ({plan.precision})")
        return rule, "bf16 at ZeRO-0 pays 4 B/param, not 2" if fp32 else "same per parameter; nothing partitioned"
    return (f"16-bit gradient partition: 1/{plan.data_ranks} per GPU from ZeRO-1 on",
            f"the textbook ZeRO-1 partitions only optimizer states; DeepSpeed's ZeRO-1 copies just this rank's "
            f"gradient partition (contiguous_gradients), as measured, so gradients cost 1/{plan.data_ranks} here"
            if plan.zero == 1 else f"ZeRO-{plan.zero} partitions gradients over dp x sp = {plan.data_ranks}")


def optimizer_offloaded(plan: Plan) -> str | None:
    """Why no optimizer state is on the GPU, when none is."""
    if plan.offload_optimizer == "none":
        return None
    return f"ZeRO-Offload keeps the optimizer states in {plan.offload_optimizer} memory: none on the GPU"


def master_copy(plan: Plan) -> str | None:
    """Whether the weights are their own master copy in every precision (the sentence saying so): they are not."""
    return None


def fp32_gradients(plan: Plan) -> str:
    """Who keeps fp32 gradients, when a replica pays more than the ZeRO paper's 16 B/param."""
    return "DeepSpeed's bf16 ZeRO-0 keeps fp32 gradients"
