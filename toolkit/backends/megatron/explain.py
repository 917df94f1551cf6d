"""What `dmt estimate --explain` says of Megatron-Core's own terms: the distributed optimizer, fp32 main grads and
Transformer Engine's fp8 weight copies.

Each function answers one question toolkit/estimate/explain.py asks every backend; None: the common sentence."""

from __future__ import annotations

from toolkit.backends.megatron.memory import main_grad_bytes
from toolkit.estimate.explain import experts_sharding
from toolkit.spec.plan import PRECISION_BYTES, Plan
from toolkit.spec.quantization import plan_recipe


def one_replica(plan: Plan) -> dict:
    """Options beyond dp = 1 that put the plan on one data-parallel replica: none."""
    return {}


def sharding(plan: Plan) -> str:
    if not plan.distributed_optimizer:
        return "none"
    return f"distributed optimizer over dp x cp = {plan.dp * plan.cp}{experts_sharding(plan)}"


def weights(plan: Plan) -> tuple[str | None, str | None]:
    """(what the weights are, why they differ from the rule of thumb)."""
    recipe = plan_recipe(plan)
    if recipe is None:
        return None, None
    copy = (f"Transformer Engine's {recipe.name} copy of each GEMM weight, row- and column-wise, "
            f"{recipe.weight_copy_bytes:.3g} B/param with scales (cached across micro-batches)")
    if plan.fp8_param_gather:
        return (f"the GEMM weights themselves in fp8 (--fp8-param-gather: no bf16 copy), {copy}; bf16 norms and "
                f"embeddings", f"the GEMM weights cost {recipe.weight_copy_bytes:.3g} B/param instead of 2 + "
                              f"{recipe.weight_copy_bytes:.3g}: the fp32 master in the optimizer is the only other copy")
    remedy = "--fp8-param-gather drops the bf16 one" if plan.precision == "fp8" else \
        "Megatron-Core has no fp4 primary weights: the bf16 one stays"
    return (f"bf16 parameters, plus {copy}", f"{plan.precision} keeps the bf16 weights beside their {recipe.name} "
                                             f"copies: {recipe.weight_copy_bytes:.3g} B per GEMM weight more "
                                             f"({remedy})")


def gradients(plan: Plan) -> tuple[str, str]:
    """(the rule, why it differs from 16-bit gradients on every GPU): the bytes are memory.py's main_grad_bytes."""
    grad = main_grad_bytes(plan)
    dtype, option = ("bf16", "--grad-reduce-in-bf16") if plan.grad_reduce_in_bf16 else ("fp32", "grad_reduce_in_fp32")
    times = grad / PRECISION_BYTES["bf16"]
    than_rule = {1: "the 16-bit rule", 2: "twice the 16-bit rule"}.get(times, f"{times:g} x the 16-bit rule")
    return (f"{dtype} main-grad buffers ({option}), one per parameter",
            f"Megatron-Core accumulates and reduces gradients in {dtype}: {grad} B/param, {than_rule}")


def optimizer_offloaded(plan: Plan) -> str | None:
    """Why no optimizer state is on the GPU, when none is: Megatron-Core offloads nothing here."""
    return None


def master_copy(plan: Plan) -> str | None:
    """Whether the weights are their own master copy in every precision (the sentence saying so): they are not."""
    return None


def fp32_gradients(plan: Plan) -> str:
    """Who keeps fp32 gradients, when a replica pays more than the ZeRO paper's 16 B/param."""
    return "Megatron-Core keeps fp32 main grads"
