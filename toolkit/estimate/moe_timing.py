"""Step-time terms of MoE layers under Megatron-Core: the rows of each local expert's GEMM, the routed copies'
memory traffic, the EP x ETP exchange (NCCL's all-to-all, or the flex dispatcher's once-per-domain forwarding), the
share of it the combined 1F1B schedule hides, and the dispatcher's fixed host-side cost per layer. step_time
(toolkit/estimate/timing.py) adds them into a stage's micro-batch."""

from __future__ import annotations

import math

from toolkit.estimate.comm import Network, collective_time
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import PRECISION_BYTES, Plan

# Seconds each MoE layer's forward (and its recomputation) costs beyond its FLOPs, bytes and all-to-alls, on every
# dispatcher: Megatron-Core's token dispatchers wait for the device to copy the tokens-per-expert counts to the host
# before the all-to-all can be sized (token_dispatcher.py: _maybe_dtoh_and_synchronize at cuda_sync_point
# "before_ep_alltoall" with ep or tp > 1, "before_finish" otherwise), which drains the GPU's queue, and then the
# host launches the permutation, the all-to-all, the sort and the grouped GEMM's per-expert setup while the GPU waits.
# Fitted, the one constant fitted on published MoE runs (issue 42 allows four rows; benchmarks/step_time_accuracy.md
# names them and refits it): least squares of the relative step-time error over Megatron-Bridge 26.04.01's Qwen3
# 30B-A3B FP8 EP 16 on 16 H100 and Qwen3 30B-A3B MXFP8 EP 8 micro-batch 4 on 8 B200 (the two runs with neither
# pipeline nor overlap, on Hopper and Blackwell), which give 2.65 and 1.84 ms alone: 2.36 ms. No other MoE row
# informed it. Only Megatron-Core's dispatchers (plans with a moe_dispatcher) pay it.
MOE_LAYER_OVERHEAD_S = 2.36e-3


def expert_rows(spec: ModelSpec, plan: Plan, tokens: float, routed: float) -> float:
    """Rows of each local expert's GEMM on the busiest expert rank per micro-batch: the rank's tokens (split by TP
    with sequence parallelism, which Megatron-Core requires of MoE under TP), gathered over its ETP group, k copies
    each, times the imbalance, over the experts it holds."""
    local_experts = max(1.0, spec.num_experts / plan.ep)
    return tokens / plan.tp * plan.expert_tp * spec.experts_top_k * routed / local_experts


def routed_token_traffic_bytes(spec: ModelSpec, plan: Plan, routed: float) -> float:
    """HBM bytes per token (before the split over TP) one MoE layer's forward and backward move outside its GEMMs, the
    memory-bound work Megatron-Core's alltoall path runs on the routed copies (moe_utils.permute / unpermute, and
    sort_chunks_by_idxs before and after the experts when a rank holds several of them under EP): permutation reads
    each token and writes its k copies, each sort reads and writes them, the fused weighted SwiGLU reads fc1's 2 ffn
    and writes ffn per copy, unpermute reads the copies and writes the token; backward moves about twice forward.
    On the busiest rank the copies are `routed` times the mean, gathered over ETP with ffn split by it. Besides:
    the experts' fc2 bias and the activation recomputed (expert_bias_elements, moe_act_recomputes)."""
    if not spec.is_moe:
        return 0.0
    h, k = spec.hidden_size, spec.experts_top_k
    ffn = spec.moe_ffn_hidden_size * (3 if spec.gated_mlp else 2) / 2  # the activation's reads and write per copy
    sorts = 2 if plan.ep > 1 and spec.num_experts > plan.ep else 0
    copies = k * routed * plan.expert_tp
    activation = 2 * ffn / plan.expert_tp  # what one copy's activation moves, its ffn split over ETP
    forward = 2 * h + copies * ((2 + 2 * sorts) * h + activation)
    extra = copies * (expert_bias_elements(spec) + moe_act_recomputes(plan) * activation)
    return (3 * forward + extra) * PRECISION_BYTES[plan.precision]


def expert_bias_elements(spec: ModelSpec) -> int:
    """Elements each routed copy moves, forward and backward, for its expert's fc2 bias (GPT-OSS's biased experts):
    Megatron-Core adds it outside the grouped GEMM, expert by expert in eager PyTorch (experts.py
    TEGroupedMLP._apply_bias: `t + b * p` over each expert's rows, then torch.cat), in the compute dtype (the router's
    probabilities take the input's unless moe_router_dtype is set, which GPT-OSS's bridge does not). Forward: b * p
    writes h, the sum reads it and fc2's output and writes h, cat reads and writes h (6 h). Backward: the gradients
    of b and of p each multiply the output's gradient (read h, write h) and reduce the product (read h): 6 h. fc1's
    bias is fused into the activation (weighted_bias_quick_geglu_impl), which moves nothing more."""
    return 12 * spec.hidden_size if spec.expert_bias else 0


def moe_act_recomputes(plan: Plan) -> int:
    """How many more times the experts' activation runs forward (0 or 1): Megatron-Core's selective moe_act
    recompute checkpoints it (CheckpointWithoutOutput in TEGroupedMLP) and runs it again before fc2's backward, reading
    fc1's output and writing its own once more, unless the whole MoE layer is recomputed ("moe")."""
    modules = plan.recompute_modules
    return int(plan.recompute == "selective" and "moe_act" in modules and "moe" not in modules)


def expert_overlap_share(plan: Plan) -> float:
    """The share of a rank's micro-batch passes that Megatron-Core's combined 1F1B schedule runs paired (one
    micro-batch's forward with another's backward, each one's all-to-alls on the communication stream beside the
    other's compute: overlap_moe_expert_parallel_comm, pipeline_parallel/combined_1f1b.py). Without a pipeline only
    the first forward and the last backward run alone (combined_1f1b_schedule_for_no_pipelining): (m-1)/m. With
    interleaving, the first rank's warm-up forwards, one more than the interleaved schedule's 2(p-1) + (v-1)p
    ("we schedule one extra micro-batch", schedules.py), and as many cool-down backwards run alone, of its m x v."""
    chunks = plan.grad_accum * plan.vpp
    alone = 1 if plan.pp == 1 else min(chunks, 2 * (plan.pp - 1) + (plan.vpp - 1) * plan.pp + 1)
    return max(0.0, 1 - alone / chunks)


def expert_parallel_domain(plan: Plan) -> int:
    """GPUs joined by the NVLink domain an EP x ETP group stays inside to avoid the network: the plan's resolved
    nvlink_domain (the GPU's, e.g. 72 on GB200 NVL72, else the node), which the network's all-to-all reads too."""
    return plan.nvlink_domain


def expert_parallel_exchange_s(spec: ModelSpec, plan: Plan, network: Network, act: float, routed: float) -> float:
    """Seconds of one MoE layer's token exchange per micro-batch, forward and backward: dispatch and combine
    all-to-alls over EP (each rank's k copies of its sequence-parallel tokens; the busiest rank receives `routed`
    times the mean, and sets the pace) and, with expert TP, the all-gather and reduce-scatter over ETP. Megatron-Core's
    expert mesh puts ETP innermost, then EP (parallel_state's expert RankGenerator), so EP ranks are ETP apart: an
    EP x ETP group within expert_parallel_domain stays on NVLink, a larger one crosses the network."""
    if not spec.is_moe:
        return 0.0
    copies = act * spec.experts_top_k / plan.tp * routed
    remote = None
    if plan.moe_dispatcher == "flex" and network.crosses_domain(plan.ep, plan.expert_tp):
        remote = act / plan.tp * routed * remote_domains_per_token(spec, plan, network)
    exchange = 4 * network.all_to_all_time(copies, plan.ep, plan.expert_tp, remote)
    if plan.expert_tp > 1:
        link = network.link(plan.expert_tp, 1)
        exchange += 2 * (collective_time("all_gather", copies * plan.expert_tp, plan.expert_tp, link)
                         + collective_time("reduce_scatter", copies * plan.expert_tp, plan.expert_tp, link))
    return exchange


def remote_domains_per_token(spec: ModelSpec, plan: Plan, network: Network) -> float:
    """Other NVLink domains of the EP group one token's k experts lie in, on average under uniform routing: what a
    hierarchical dispatch sends across the network per token. The flex dispatcher's kernels (DeepEP, HybridEP) send a
    token once to each domain holding one of its experts and fan it out over NVLink there (DeepSeek-V3 report,
    arXiv:2412.19437 Sec. 3.2.2; deepseek-ai/DeepEP README, "NVLink-to-RDMA forwarding"), where NCCL's all-to-all
    sends each of the k copies. A domain holds E/N of the E experts; it holds none of a token's k distinct experts
    with probability C(E - E/N, k) / C(E, k). Group-limited routing (DeepSeek-V3's topk_group) can only lower it."""
    domains = plan.ep // network.ranks_per_domain(plan.ep, plan.expert_tp)
    experts, k = spec.num_experts, spec.experts_top_k
    outside = experts - experts // domains
    return (domains - 1) * (1 - math.comb(outside, k) / math.comb(experts, k))


def moe_layer_overhead_s(plan: Plan) -> float:
    """Seconds each MoE layer forward costs the plan beyond its work: MOE_LAYER_OVERHEAD_S where Megatron-Core's
    token dispatchers run (a plan with a moe_dispatcher); the HF backends' MoE modules are not what it was fitted on."""
    return MOE_LAYER_OVERHEAD_S if plan.moe_dispatcher is not None else 0.0
