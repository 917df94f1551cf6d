"""Megatron-Core's step-time terms: its layer modules' execution path, and the fp32 main grads' reduction over the
data-parallel x context-parallel group (with the distributed optimizer, a reduce-scatter and a parameter all-gather)."""

from __future__ import annotations

from toolkit.estimate.comm import Network, collective_time
from toolkit.estimate.efficiency import MEGATRON_LOCAL, MEGATRON_TE, ExecutionPath
from toolkit.estimate.memory import FP32
from toolkit.estimate.timing import exposed_after_backward, optimizer_step_s
from toolkit.spec.cluster import GPU
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import PRECISION_BYTES, Plan


def execution_path(plan: Plan) -> ExecutionPath:
    """Transformer Engine's layers unless the plan asks for the local spec."""
    return MEGATRON_LOCAL if plan.transformer_impl == "local" else MEGATRON_TE


def data_parallel_and_optimizer(spec: ModelSpec, plan: Plan, gpu: GPU, network: Network, compute_micro: float,
                                params_total: int, trainable: int) -> tuple[float, float, float]:
    """(exposed gradient reduction, optimizer step, 0: nothing offloaded) per step, in seconds."""
    a = PRECISION_BYTES[plan.precision]
    dp_group = plan.dp * plan.cp
    link = network.link(dp_group, plan.tp)  # tp is innermost; the dp x cp group sits right above it
    grad_bytes = params_total * FP32  # fp32 main grads
    if plan.distributed_optimizer:
        comm = collective_time("reduce_scatter", grad_bytes, dp_group, link)
        comm += collective_time("all_gather", params_total * a, dp_group, link)
    else:
        comm = collective_time("all_reduce", grad_bytes, dp_group, link)
    partition = params_total / (dp_group if plan.distributed_optimizer else 1)
    return exposed_after_backward(comm, compute_micro), optimizer_step_s(partition, gpu), 0.0
