"""Predicted time of one optimizer step: compute, exposed communication, pipeline bubble, optimizer and offload.

Overlap is explicit, not assumed perfect: tensor-parallel traffic sits on the critical path (Megatron-Core does not
overlap it without Transformer Engine userbuffers), and so does the expert all-to-all unless the plan runs
Megatron-Core's combined 1F1B schedule (--overlap-moe-expert-parallel-comm); data-parallel gradient reduction overlaps
with the last micro-batch's backward up to DP_OVERLAP of it; context-parallel KV exchange hides behind attention
compute. What each backend sends for its data-parallel ranks, how its optimizer steps and what it offloads (ZeRO's
gathers and buckets, FSDP2's, Megatron-Core's distributed optimizer) are its timing part,
toolkit/backends/<name>/timing.py, reached through `backend_of(plan).timing`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from toolkit.estimate.activations import FP32, routed_token_factor, ulysses_kv_copies
from toolkit.estimate.attention_rate import fused_attention_work
from toolkit.estimate.comm import Network, collective_time
from toolkit.estimate.device_peak import peak_flops
from toolkit.estimate.efficiency import (
    UNFUSED_ATTENTION_BACKWARD_BYTES,
    UNFUSED_ATTENTION_FORWARD_BYTES,
    ExecutionPath,
    calibrated_path,
    execution_path,
    expert_hidden,
    path_gemm_efficiency,
    unfused_rotary_elements,
)
from toolkit.estimate.flops import (
    head_forward_flops,
    layer_forward_flops,
    model_flops_per_token,
    mtp_projection_flops,
    recomputed_forward,
)
from toolkit.estimate.long_context import tile_recompute_forwards
from toolkit.estimate.lora import adapter_forward_flops, finetune_counts
from toolkit.estimate.memory import (
    recomputed_layers,
    representative_stages,
    stage_layers,
    stage_model_states,
    trains_mtp,
)
from toolkit.estimate.moe_timing import (
    expert_overlap_share,
    expert_parallel_exchange_s,
    expert_rows,
    moe_layer_overhead_s,
    routed_token_traffic_bytes,
)
from toolkit.estimate.packed_attention import attended_tokens
from toolkit.spec.backends import backend_of
from toolkit.spec.calibration import Calibration
from toolkit.spec.cluster import GPU
from toolkit.spec.finetune import FinetuneOptions
from toolkit.spec.model import ModelSpec, by_identity
from toolkit.spec.plan import PRECISION_BYTES, Plan
from toolkit.spec.prediction import PackedAttention
from toolkit.spec.quantization import gemm_peak_key, plan_recipe

DP_OVERLAP = 0.8
# Adam over a parameter partition touches ~28 B/param of HBM (read master, m, v, grad; write master, m, v, bf16 copy)
OPTIMIZER_BYTES_TOUCHED = 28
HBM_EFFICIENCY = 0.7
# DeepSpeed's CPU Adam on a typical 2-socket host (ZeRO-Offload, arXiv:2101.06840, Sec. 5): ~1e9 params/s per node
CPU_ADAM_PARAMS_PER_S_PER_NODE = 1.0e9
STEP_COMPONENTS = ("compute_s", "tp_comm_s", "cp_comm_s", "sp_comm_s", "ep_comm_s", "moe_overhead_s", "pp_comm_s",
                   "bubble_s", "dp_comm_s", "optimizer_s", "offload_s", "fixed_s")


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    sp_comm_s: float  # Ulysses' all-to-alls (DeepSpeed's UlyssesSPAttentionHF), on the critical path
    ep_comm_s: float
    moe_overhead_s: float  # each MoE layer's fixed host-side cost per pass (MOE_LAYER_OVERHEAD_S)
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float
    optimizer_s: float
    offload_s: float
    fixed_s: float  # the execution path's fixed per-step cost (0 unless `dmt calibrate` fitted one)
    total_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (no recomputation) per second per GPU
    mfu: float
    execution_path: str  # toolkit/estimate/efficiency.py EXECUTION_PATHS
    peak_tflops: float  # the dense peak of one GPU (rank) at the plan's precision that mfu is a fraction of

    def as_dict(self) -> dict:
        return asdict(self)


def calibrated(gpu: GPU, network: Network, calibration: Calibration | None) -> tuple[GPU, Network]:
    """The hardware figures a calibration replaces: the host's matmul peak it was fitted with (the `cpu` entry), and
    the link bus bandwidths `dmt health` measured (where this command was not given its own)."""
    if calibration is None:
        return gpu, network
    if gpu.host and calibration.host_peak_tflops:
        gpu = gpu.model_copy(update={"peak_tflops": {**gpu.peak_tflops, **calibration.host_peak_tflops}})
    if calibration.links is not None:
        network = network.with_measured(intra=calibration.links.intra_node_busbw_gbps,
                                        inter=calibration.links.inter_node_busbw_gbps)
    return gpu, network


def step_time(spec: ModelSpec, plan: Plan, gpu: GPU, network: Network, path: ExecutionPath | None = None,
              calibration: Calibration | None = None, packed: PackedAttention | None = None) -> StepTime:
    """`path`: the execution path, the kernels the step runs (toolkit/estimate/efficiency.py); by default the plan's
    own. `calibration` (`dmt calibrate`): its compute scale and fixed per-step cost for the execution path and its
    measured hardware figures (see `calibrated`) replace the published ones; this is the one place a calibration
    enters a prediction. `packed`: the attention a recipe's packed documents cost (toolkit/estimate/packed_attention.py;
    None: the whole sequence)."""
    gpu, network = calibrated(gpu, network, calibration)
    network = network.for_plan(plan)  # the plan's node size, NVLink domain and scale-out tier
    a = PRECISION_BYTES[plan.precision]
    # fp8 / fp4: the GEMMs run at their recipe's peak, attention (fp8_dot_product_attention off) and the rest at bf16's
    peak = peak_flops(gpu, plan.precision, plan.gpus_per_node, key=gemm_peak_key(plan, gpu))
    attention_peak = peak_flops(gpu, "bf16", plan.gpus_per_node) if plan_recipe(plan) else peak
    tokens = plan.micro_batch * plan.seq_len // plan.sequence_split  # per rank per micro-batch
    path = calibrated_path(path or execution_path(plan), calibration)
    efficiency = path_gemm_efficiency(path, spec.hidden_size, plan.tp, tokens)
    hbm = hbm_bytes_per_s(gpu)
    # GEMM-rate equivalent of one attention FLOP: fused kernels on the blocks they run (the sequence, or CP's ring
    # blocks) at their own rate (toolkit/estimate/attention_rate.py), a sliding-window layer's band at its own; the
    # unfused execution path computes the whole score matrix with cuBLAS batched GEMMs and moves it through memory
    block = plan.seq_len / (2 * plan.cp) if plan.cp > 1 else plan.seq_len
    attention_work = 1.0 if path.unfused_attention else fused_attention_work(block, spec.head_dim)
    window_work = (attention_work if path.unfused_attention or spec.sliding_window is None
                   else fused_attention_work(block, spec.head_dim, spec.sliding_window))
    # seconds per token and layer the unfused execution path spends moving scores (heads/tp x s elements per token)
    # in the forward and in the backward
    scores = spec.num_attention_heads / plan.tp * plan.seq_len / hbm if path.unfused_attention else 0.0
    score_forward_s, score_backward_s = scores * UNFUSED_ATTENTION_FORWARD_BYTES, scores * UNFUSED_ATTENTION_BACKWARD_BYTES
    # seconds per token and layer of rotary embedding run eagerly where the execution path's rate assumes it fused
    rotary_forward_s, rotary_backward_s = (n * a / plan.tp / hbm for n in unfused_rotary_elements(spec, path))

    # The slowest stage sets the pipeline's pace: every stage's micro-batch time, compute and exposed communication.
    act = tokens * spec.hidden_size * a  # one activation tensor of a micro-batch
    tp_link = network.link(plan.tp, 1)
    # 2 collectives per layer per forward (attention, MLP) and 2 in backward; a recomputed block or MLP repeats its own
    tp_collective = collective_time("all_reduce", act, plan.tp, tp_link)
    cp_link = network.link(plan.cp, plan.tp)
    kv_bytes = 2 * tokens * spec.num_kv_heads * spec.head_dim * a / plan.tp
    cp_per_layer = 3 * collective_time("all_gather", kv_bytes * plan.cp, plan.cp, cp_link)
    ring_step_s = context_parallel_ring_step_s(spec, plan, tokens, hbm, cp_link.latency_s)
    # Ulysses: q, k, v to the head-sharded layout before attention and the output back, each again in backward
    kv_heads = spec.num_kv_heads * ulysses_kv_copies(spec, plan.sp)
    sp_forward = (network.all_to_all_time(tokens * (spec.num_attention_heads + 2 * kv_heads) * spec.head_dim * a,
                                          plan.sp, plan.tp)
                  + network.all_to_all_time(act, plan.sp, plan.tp))
    routed = routed_token_factor(plan.ep, plan.moe_imbalance) if spec.is_moe else 1.0
    ep_per_moe_layer = expert_parallel_exchange_s(spec, plan, network, act, routed)
    routed_traffic_s = routed_token_traffic_bytes(spec, plan, routed) / plan.tp / hbm  # per token of the rank
    expert_rate = peak * path_gemm_efficiency(path, expert_hidden(spec.hidden_size, spec.moe_ffn_hidden_size or 1),
                                              plan.expert_tp, expert_rows(spec, plan, tokens, routed)) \
        if spec.is_moe else 1.0
    pp_link = network.link(plan.pp, plan.tp * plan.cp * plan.dp)
    p2p_bytes = act / (plan.tp if plan.sequence_parallel else 1)
    p2p = collective_time("p2p", p2p_bytes, plan.pp, pp_link) if plan.pp > 1 else 0.0

    stages = []
    rate = peak * efficiency
    attention_rate = attention_peak * efficiency
    attended = attended_tokens(plan.seq_len, packed)
    # backward runs the input-gradient GEMM of every linear layer, and the weight-gradient one only where the weight
    # trains: a frozen base (LoRA) skips the latter, a third of its matmul work; its adapters train in full
    ft = plan.finetune
    matmul_passes = 2 if ft.peft else 3
    mtp = trains_mtp(spec, plan)
    for stage in representative_stages(spec, plan):
        layers = stage_layers(spec.num_layers, plan, stage)
        last = stage == plan.pp - 1
        # Megatron-Core runs the multi-token prediction modules after the last stage's layers, each a block like the
        # model's last (recomputed as it is) besides its eh_proj and the shared head (below)
        blocks = (*layers, *[spec.num_layers - 1] * (spec.mtp_layers if last and mtp else 0))
        recomputed = recomputed_layers(spec, plan, stage)
        (work, attention, memory_bound, attention_run, expert_work, collectives, sp_exchanges, moe_blocks,
         moe_passes, again) = _layer_passes(spec, ft, blocks, attended, plan.recompute, plan.recompute_modules,
                                            recomputed, plan.tiled_mlp, matmul_passes, (attention_work, window_work),
                                            routed_traffic_s, score_forward_s, score_backward_s)
        memory_bound += len(blocks) * (rotary_forward_s + rotary_backward_s) + again * rotary_forward_s
        if last:
            work += matmul_passes * (head_forward_flops(spec) + (spec.mtp_layers * mtp_projection_flops(spec)
                                                                   if mtp else 0.0))
        compute = (tokens * (work / plan.tp / rate + attention_run / plan.tp / attention_rate + memory_bound)
                   + tokens * expert_work * routed / plan.tp / expert_rate)
        attention_time = tokens * attention * 3 / plan.tp / attention_rate
        # the ring's exchange hides behind attention; its steps' merges and waits do not
        # cp ring steps per attention pass: forward, backward, and a recomputed forward (as Ulysses' exchanges)
        cp_comm = max(0.0, len(blocks) * cp_per_layer - attention_time) + plan.cp * sp_exchanges * ring_step_s
        ep_comm = moe_blocks * ep_per_moe_layer
        moe_overhead = moe_passes * moe_layer_overhead_s(plan)
        if plan.overlap_moe_expert_parallel_comm:  # behind the paired micro-batch's compute stream, waits included
            ep_comm -= min(ep_comm, compute + moe_overhead) * expert_overlap_share(plan)
        tp_comm = collectives * tp_collective
        pp_comm = pipeline_exchanges(plan, stage) * p2p
        sp_comm = sp_exchanges * sp_forward
        stages.append((compute + tp_comm + cp_comm + sp_comm + ep_comm + moe_overhead + pp_comm, compute, tp_comm,
                       cp_comm, sp_comm, ep_comm, moe_overhead, pp_comm, stage))
    micro, compute_micro, tp_comm, cp_comm, sp_comm, ep_comm, moe_overhead, pp_comm, _ = max(stages)

    m = plan.grad_accum
    bubble = pipeline_bubble_s(plan, {stage[-1]: stage[0] for stage in stages})

    dp_comm, optimizer_s, offload_s = _data_parallel_and_optimizer(spec, plan, gpu, network, compute_micro)
    offload_s += m * activation_offload_s(spec, plan, gpu, tokens)
    total = m * micro + bubble + dp_comm + optimizer_s + offload_s + path.fixed_step_s
    step_tokens = plan.global_batch * plan.seq_len
    model_flops = useful_flops_per_token(spec, plan, packed) * step_tokens
    tflops = model_flops / total / plan.gpus
    return StepTime(
        compute_s=m * compute_micro,
        tp_comm_s=m * tp_comm,
        cp_comm_s=m * cp_comm,
        sp_comm_s=m * sp_comm,
        ep_comm_s=m * ep_comm,
        moe_overhead_s=m * moe_overhead,
        pp_comm_s=m * pp_comm,
        bubble_s=bubble,
        dp_comm_s=dp_comm,
        optimizer_s=optimizer_s,
        offload_s=offload_s,
        fixed_s=path.fixed_step_s,
        total_s=total,
        tokens_per_s=step_tokens / total,
        tflops_per_gpu=tflops / 1e12,
        mfu=tflops / peak,
        execution_path=path.name,
        peak_tflops=peak / 1e12,
    )


def _recomputes_whole(recompute: str, recomputed: frozenset[int] | None, layer: int) -> bool:
    """Whether full recompute runs `layer`'s whole forward again in backward (`recomputed`: recomputed_layers'
    answer, None for every layer)."""
    return recompute == "full" and (recomputed is None or layer in recomputed)


@by_identity(2)
def _layer_passes(spec: ModelSpec, ft: FinetuneOptions, blocks: tuple[int, ...], attended: float, recompute: str,
                  recompute_modules: tuple[str, ...], recomputed: frozenset[int] | None, tiled_mlp: bool,
                  matmul_passes: int, attention_works: tuple[float, float], routed_traffic_s: float,
                  score_forward_s: float, score_backward_s: float
                  ) -> tuple[float, float, float, float, float, int, float, int, int, int]:
    """What one pipeline rank's blocks run per token and micro-batch (step_time): (FLOPs at the GEMMs' rate,
    attention's FLOPs, memory-bound seconds, attention's work at its rate, the routed experts' FLOPs, tensor-parallel
    collectives, sequence-split exchanges, MoE blocks, MoE layer forwards, blocks whose whole forward full recompute
    runs again). `attention_works`: the GEMM-rate work of
    one attention FLOP of a full-length layer and of a sliding-window one. Remembered: a search asks the same of
    every micro-batch of a layout."""
    work = attention = memory_bound = 0.0  # FLOPs run per token (forward + backward x3 plus recomputation)
    attention_run = 0.0  # of those, attention's score and value products (at attention_rate)
    expert_work = 0.0  # the routed experts' share, at their grouped GEMMs' rate, on the busiest EP rank
    moe_passes = 0  # MoE layer forwards (recomputed ones again), each paying the dispatcher's fixed cost
    collectives = 0
    sp_exchanges = 0.0
    for i in blocks:
        f = layer_forward_flops(spec, i, attended)
        window = spec.attention_window(i)
        attention_work = attention_works[window is not None and window < attended]
        whole = _recomputes_whole(recompute, recomputed, i)
        again = recomputed_forward(f, recompute, recompute_modules, whole)
        work += matmul_passes * f.matmul + 3 * adapter_forward_flops(spec, ft, i)
        work += again.matmul
        attention_run += (3 * f.attention + again.attention) * attention_work
        work += f.mlp_matmul * tile_recompute_forwards(tiled_mlp)  # TiledMLP's forward again in backward
        if f.expert_matmul:
            moe_passes += 2 if whole or "moe" in recompute_modules else 1
            memory_bound += routed_traffic_s * (2 if whole or "moe" in recompute_modules else 1)
            again_expert = f.expert_matmul if whole or "moe" in recompute_modules else 0.0
            work -= matmul_passes * f.expert_matmul + again_expert
            expert_work += matmul_passes * f.expert_matmul + again_expert
        sp_exchanges += 2 + (1 if again.attention else 0)  # forward, backward, and a recomputed forward
        attention += f.attention * attention_work
        memory_bound += score_backward_s + score_forward_s * (2 if again.attention else 1)
        collectives += 4 + (2 if whole else 1 if again.mlp_matmul else 0)
    moe_blocks = sum(spec.is_moe_layer(i) for i in blocks)
    again = sum(_recomputes_whole(recompute, recomputed, i) for i in blocks)
    return (work, attention, memory_bound, attention_run, expert_work, collectives, sp_exchanges, moe_blocks, moe_passes,
            again)


def context_parallel_ring_step_s(spec: ModelSpec, plan: Plan, tokens: float, hbm: float, latency_s: float) -> float:
    """Seconds one step of context parallelism's attention ring costs beyond its attention FLOPs and the exchange
    they hide (cp steps forward, cp backward; Transformer Engine's AttnFuncWithCPAndKVP2P): the wait for the peer's
    block (the link's per-hop latency) and the merge of the partial results, memory-bound: forward reads and writes
    the fp32 output and its log-sum-exp, backward accumulates dq in fp32 and dk, dv travel on with their blocks.
    Averaged over forward and backward steps."""
    if plan.cp <= 1:
        return 0.0
    q = spec.num_attention_heads * spec.head_dim / plan.tp
    kv = spec.num_kv_heads * spec.head_dim / plan.tp
    forward = 2 * FP32 * (q + spec.num_attention_heads / plan.tp) * tokens
    backward = 2 * FP32 * (q + 2 * kv) * tokens
    return latency_s + (forward + backward) / 2 / hbm


def pipeline_exchanges(plan: Plan, stage: int) -> int:
    """Blocking point-to-point exchanges a pipeline rank waits for per micro-batch, as Megatron-Core's schedules issue
    them (megatron/core/pipeline_parallel/schedules.py): 1F1B's steady state calls send_forward_recv_backward after a
    forward and send_backward_recv_forward after a backward, and on the first and the last stage one of the two has no
    peer (nothing comes before the embedding, nothing after the loss); interleaved, every rank sends and receives
    around each of its chunks' forwards and backwards."""
    if plan.pp == 1:
        return 0
    boundary = plan.vpp == 1 and stage in (0, plan.pp - 1)
    return 2 * plan.vpp - (1 if boundary else 0)


def pipeline_bubble_s(plan: Plan, stage_micro_s: dict[int, float]) -> float:
    """The pipeline's fill and drain: (p-1)/v micro-batch times (Narayanan et al., arXiv:2104.04473 Sec. 2.2), each
    the time of a stage that does not set the pace. The slowest stage (the last with its head and loss, or the first
    with its embedding) runs its m micro-batches back to back once the first input reaches it; the fill before that
    and the drain after it are the other stages' forwards and backwards, so its own extra work is paid m times,
    not m + p - 1 (an event-driven run of the 1F1B order, tests/unit/test_pipeline_schedule.py, agrees, and so do
    Megatron-Core's own schedules timed on CPU ranks, benchmarks/pipeline_schedule_cpu.md).
    `stage_micro_s`: the micro-batch time of each representative stage (toolkit/estimate/memory.py); a middle one
    stands for every rank like it, so when one sets the pace, others like it fill and drain."""
    if plan.pp == 1:
        return 0.0
    pace = max(stage_micro_s, key=stage_micro_s.get)
    others = [t for stage, t in stage_micro_s.items() if stage != pace or stage not in (0, plan.pp - 1)]
    return max(others) * (plan.pp - 1) / plan.vpp


def useful_flops_per_token(spec: ModelSpec, plan: Plan, packed: PackedAttention | None = None) -> float:
    """The model FLOPs per token MFU counts for this plan (no recomputation, PaLM convention): the whole model's
    forward and backward, or, fine-tuning with adapters, the work that needs (what a run's measured MFU counts too).
    Attention follows the convention of the published rows MFU is compared with (Megatron-LM arXiv:2104.04473, Llama 3
    arXiv:2407.21783, benchmarks/step_time_accuracy.md): the full, not causally halved, score matrix of what attention
    attends, which is the whole sequence, or with `packed` documents under a variable-length kernel each document
    piece's own square (the attention it needs; Megatron-LM's num_floating_point_operations counts seq_len even there,
    so its logged MFU of such a run reads higher)."""
    attended = attended_tokens(plan.seq_len, packed)
    if plan.finetune.peft:  # no weight gradients of the base, the adapters' three passes
        return _finetune_model_flops(spec, plan, attended)
    return model_flops_per_token(spec, attended, mtp=trains_mtp(spec, plan))


def _finetune_model_flops(spec: ModelSpec, plan: Plan, attended: float) -> float:
    """Model FLOPs per token of LoRA training (no recomputation): forward and input gradients of the base's matmuls,
    attention's three passes, and the adapters' forward, input and weight gradients."""
    matmul = sum(layer_forward_flops(spec, i, attended).matmul for i in range(spec.num_layers))
    matmul += head_forward_flops(spec)
    attention = sum(layer_forward_flops(spec, i, attended).attention for i in range(spec.num_layers))
    adapters = sum(adapter_forward_flops(spec, plan.finetune, i) for i in range(spec.num_layers))
    return 2 * matmul + 3 * (attention + adapters)


def _data_parallel_and_optimizer(
    spec: ModelSpec, plan: Plan, gpu: GPU, network: Network, compute_micro: float
) -> tuple[float, float, float]:
    """(exposed data-parallel communication, optimizer step, offload transfers) per step, in seconds: the backend's
    own (its timing part), over the first stage's parameters and those of them that train."""
    params, _ = stage_model_states(spec, plan, 0)
    # gradients are reduced and the optimizer steps over the trainable parameters only (LoRA: the adapters)
    trainable = finetune_counts(spec, plan.finetune).adapters if plan.finetune.peft else params.total
    return backend_of(plan).timing.data_parallel_and_optimizer(spec, plan, gpu, network, compute_micro,
                                                                      params.total, trainable)


def activation_offload_s(spec: ModelSpec, plan: Plan, gpu: GPU, tokens: int) -> float:
    """Seconds per micro-batch of activation offload: every checkpointed layer input to the host in forward and back
    before its recomputation, over PCIe (not hidden: the copies wait on the layer that makes or needs them)."""
    if plan.offload_activations == "none":
        return 0.0
    layer_input = tokens * spec.hidden_size * PRECISION_BYTES[plan.precision]
    return 2 * spec.num_layers / plan.pp * layer_input / (gpu.pcie_bw_gbps * 1e9)


def hbm_bytes_per_s(gpu: GPU) -> float:
    """The HBM bandwidth memory-bound kernels reach."""
    return gpu.hbm_bandwidth_gbps * 1e9 * HBM_EFFICIENCY


def optimizer_step_s(partition: float, gpu: GPU) -> float:
    """Seconds the optimizer takes over `partition` parameters on the GPU: memory-bound, OPTIMIZER_BYTES_TOUCHED each."""
    return partition * OPTIMIZER_BYTES_TOUCHED / hbm_bytes_per_s(gpu)


def exposed_after_backward(comm_s: float, compute_micro: float) -> float:
    """What of a gradient reduction the last micro-batch's backward (2/3 of its compute) does not hide."""
    backward_window = compute_micro * 2 / 3
    return max(0.0, comm_s - DP_OVERLAP * backward_window)


def exposed_after_cooldown(chunk_comm_s: list[float], chunk_backward_s: float, pp: int) -> float:
    """What of the gradient reductions of an interleaved pipeline's first rank (the last to finish) outlasts its
    last backward. Megatron-Core's interleaved schedule with per-chunk grad_sync_func (what Megatron-LM and the
    training backend install under overlap_grad_reduce) launches chunk c's reduction once its last micro-batch's
    backward is done, and c x pp chunk backwards still follow it on that rank (the last group of pp micro-batches of
    each chunk below; tests/unit/test_pipeline_schedule.py counts them in schedules.py's own order); the first
    chunk's, launched after the very last backward, is hidden by nothing. The reductions queue on one link, and a
    backward hides DP_OVERLAP of its time, as under 1F1B.
    `chunk_comm_s`: each chunk's reduction; `chunk_backward_s`: one chunk's backward of one micro-batch."""
    finished = float("-inf")  # seconds after the rank's last backward
    for chunk in reversed(range(len(chunk_comm_s))):
        finished = max(finished, -chunk * pp * chunk_backward_s * DP_OVERLAP) + chunk_comm_s[chunk]
    return max(0.0, finished)
