"""Megatron-Core's step-time terms: its layer modules' execution path, and the main grads' reduction (fp32, or bf16
with --grad-reduce-in-bf16) over the data-parallel x context-parallel group (with the distributed optimizer, a reduce-scatter and a parameter all-gather)."""

from __future__ import annotations

from toolkit.backends.megatron.memory import main_grad_bytes
from toolkit.estimate.comm import Network, collective_time
from toolkit.estimate.efficiency import MEGATRON_LOCAL, MEGATRON_TE, ExecutionPath
from toolkit.estimate.memory import layer_params, stage_model_states
from toolkit.estimate.params import count_params
from toolkit.estimate.timing import exposed_after_backward, exposed_after_cooldown, optimizer_step_s
from toolkit.spec.cluster import GPU
from toolkit.spec.model import ModelSpec
from toolkit.spec.pipeline import PipelineSplit
from toolkit.spec.plan import PRECISION_BYTES, Plan
from toolkit.spec.quantization import plan_recipe


def execution_path(plan: Plan) -> ExecutionPath:
    """Transformer Engine's layers unless the plan asks for the local spec."""
    return MEGATRON_LOCAL if plan.transformer_impl == "local" else MEGATRON_TE


def data_parallel_and_optimizer(spec: ModelSpec, plan: Plan, gpu: GPU, network: Network, compute_micro: float,
                                params_total: int, trainable: int) -> tuple[float, float, float]:
    """(exposed gradient reduction, optimizer step, 0: nothing offloaded) per step, in seconds.

    The routed experts' weights are reduced (and, with the distributed optimizer, sharded and gathered) over the
    expert-data-parallel group, not the dense one: Megatron-Core's expert mesh (parallel_state's expert
    RankGenerator, ETP innermost, then EP, then EDP) makes it world / (pp x ep x etp) ranks, ep x etp apart, so an EP
    group that fills the NVLink domain leaves one rank of each EDP group per domain, on that rank's NIC."""
    dp_group = plan.dp * plan.cp
    link = network.link(dp_group, plan.tp)  # tp is innermost; the dp x cp group sits right above it
    # the experts' share of the first stage's parameters (a frozen base trains adapters only: all dense)
    expert = 0 if plan.finetune.peft else min(params_total, stage_model_states(spec, plan, 0)[0].expert)
    expert_group = plan.dp * plan.cp * plan.tp // (plan.ep * plan.expert_tp)
    groups = ((params_total - expert, dp_group, link),
              (expert, expert_group, network.link(expert_group, plan.ep * plan.expert_tp)))
    gathered = gathered_param_bytes(spec, plan, params_total) / max(1, params_total)  # bytes per parameter
    grad = main_grad_bytes(plan)  # the main-grad buffers' dtype is what the reduction moves
    comm = partition = 0.0
    for params, group, group_link in groups:
        if not params:
            continue
        if plan.distributed_optimizer:
            comm += collective_time("reduce_scatter", params * grad, group, group_link)
            comm += collective_time("all_gather", params * gathered, group, group_link)
        else:
            comm += collective_time("all_reduce", params * grad, group, group_link)
        partition += params / (group if plan.distributed_optimizer else 1)
    if plan.vpp == 1:  # the first rank turns its gradient hooks on for its last backward (schedules.py, 1F1B)
        exposed = exposed_after_backward(comm, compute_micro)
    else:
        shares = first_rank_chunk_params(spec, plan, params_total)
        exposed = exposed_after_cooldown([comm * share / params_total for share in shares],
                                         compute_micro * 2 / 3 / plan.vpp, plan.pp)
    return exposed, optimizer_step_s(partition, gpu), 0.0


def gathered_param_bytes(spec: ModelSpec, plan: Plan, params_total: int) -> float:
    """Bytes the distributed optimizer all-gathers of the first stage's parameters: all in the training dtype, or with
    --fp8-param-gather the GEMM weights in their recipe's row-wise usage (Megatron-Core gathers the fp8 data and
    makes the column-wise one after it, fp8_utils.post_all_gather_processing)."""
    a = PRECISION_BYTES[plan.precision]
    recipe = plan_recipe(plan)
    if not plan.fp8_param_gather or recipe is None:
        return params_total * a
    gemm = stage_model_states(spec, plan, 0)[0].gemm
    return (params_total - gemm) * a + gemm * (recipe.element_bytes + recipe.weight_scale_bytes)


def first_rank_chunk_params(spec: ModelSpec, plan: Plan, params_total: int) -> list[int]:
    """The first pipeline rank's parameters by model chunk: each chunk's layers, and the embedding (all that is not
    a layer) on the first chunk."""
    counts = count_params(spec)
    chunks = [sum(sum(layer_params(counts, plan, i)) for i in chunk) for chunk in PipelineSplit.of(spec.num_layers,
                                                                                                    plan).chunks()[0]]
    return [params_total - sum(chunks[1:]), *chunks[1:]]
