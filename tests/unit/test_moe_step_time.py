"""Step-time terms of MoE layers and context parallelism: the busiest expert rank sets the pace, expert GEMMs are
priced by the rows each local expert gets, the EP exchange by where its group lies, CP's ring steps cost what their
merges and waits cost, and `dmt plan --explain` names what sets the winner apart from a tuned published layout."""


from pytest import approx

from toolkit.estimate.attention_rate import attention_block_rate
from toolkit.estimate.comm import Network
from toolkit.estimate.efficiency import expert_gemm_efficiency, gemm_efficiency
from toolkit.estimate.flops import model_flops_per_token, mtp_forward_flops
from toolkit.estimate.moe_timing import expert_rows
from toolkit.estimate.timing import step_time, useful_flops_per_token
from toolkit.planner.tuned_layouts import TUNED_LAYOUTS, against_tuned, tuned_step
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

H100 = get_gpu("h100-80gb")
NETWORK = Network.from_catalogue(H100, 8)
QWEN = dict(backend="megatron", micro_batch=1, global_batch=256, seq_len=4096, precision="bf16",
            distributed_optimizer=True, recompute="none")


def _time(model, gpus, **options):
    return step_time(model, resolve_plan(model, gpus, **{**QWEN, **options}), H100, NETWORK)


def test_the_busiest_expert_rank_sets_the_pace_up_to_ep():
    model = load_model_spec("qwen3-30b-a3b")
    balanced, skewed, capped = (_time(model, 16, ep=8, moe_imbalance=f) for f in (1.0, 1.5, 100.0))
    # the bytes scale with the busiest rank's share, the per-hop latencies do not
    assert 1.4 * balanced.ep_comm_s < skewed.ep_comm_s < 1.5 * balanced.ep_comm_s
    assert capped.ep_comm_s == _time(model, 16, ep=8, moe_imbalance=8.0).ep_comm_s  # at most every copy on one rank
    assert capped.ep_comm_s > 7 * balanced.ep_comm_s
    assert balanced.compute_s < skewed.compute_s < capped.compute_s


def test_expert_gemms_are_priced_by_the_rows_each_local_expert_gets():
    model = load_model_spec("qwen3-30b-a3b")  # 128 experts, top 8
    plan = resolve_plan(model, 16, **{**QWEN, "ep": 8})
    rows = expert_rows(model, plan, plan.micro_batch * plan.seq_len, 1.0)
    assert rows == 4096 * 8 / 16  # the rank's 4,096 tokens, 8 copies each, over its 16 experts
    assert expert_gemm_efficiency(model.hidden_size, model.moe_ffn_hidden_size, 1, rows) < gemm_efficiency(
        model.hidden_size, 1, 4096)
    # fewer rows per expert (a shorter micro-batch) run at a lower rate: more seconds per expert FLOP
    short = _time(model, 16, ep=8, seq_len=512, global_batch=2048)
    long = _time(model, 16, ep=8)
    assert short.compute_s > long.compute_s * 0.999


def test_the_ep_exchange_costs_more_across_the_network_than_inside_a_node():
    model = load_model_spec("qwen3-30b-a3b")
    inside = _time(model, 16, ep=8).ep_comm_s
    across = _time(model, 16, ep=16).ep_comm_s
    assert across > 2 * inside > 0


def test_context_parallel_ring_costs_its_steps_and_short_blocks():
    assert attention_block_rate(1024) < attention_block_rate(4096) < attention_block_rate(16384) == 1.0
    model = load_model_spec("llama-3.1-70b")
    common = dict(backend="megatron", micro_batch=1, global_batch=256, seq_len=8192, precision="fp8",
                  distributed_optimizer=True, sequence_parallel=True, recompute="none", tp=2, pp=8)
    cp4 = step_time(model, resolve_plan(model, 64, cp=4, **common), H100, NETWORK)
    assert cp4.cp_comm_s > 0.02 * cp4.total_s  # the ring's merges and waits are not hidden behind attention


def test_explain_names_what_sets_the_winner_apart_from_the_tuned_layout():
    """NVIDIA's tuned tp4 pp8 vpp5 for Llama 3 70B FP8 on 64 H100 against the planner's tp2 pp8 cp4: no longer 15%
    apart, and what is left is named term by term."""
    model = load_model_spec("llama-3.1-70b")
    tuned = next(t for t in TUNED_LAYOUTS if t.model == "llama-3.1-70b")
    _, tuned_time = tuned_step(model, tuned, H100, NETWORK)
    plan = resolve_plan(model, 64, backend="megatron", tp=2, pp=8, cp=4, micro_batch=1, global_batch=256,
                        seq_len=8192, precision="fp8", distributed_optimizer=True, sequence_parallel=True,
                        recompute="none")
    winner = step_time(model, plan, H100, NETWORK)
    assert tuned_time.total_s / winner.total_s - 1 < 0.15
    line = against_tuned(model, plan, winner, H100, NETWORK)
    assert "tp4 pp8 vpp5" in line and "Megatron-Bridge" in line
    if tuned_time.total_s / winner.total_s - 1 > 0.10:
        assert "s less tp comm" in line
    other = resolve_plan(model, 64, **{**QWEN, "seq_len": 2048})
    assert against_tuned(model, other, winner, H100, NETWORK) is None


def test_megatron_trains_the_mtp_modules_on_the_last_stage_and_hf_backends_drop_them():
    """DeepSeek-V3's one multi-token prediction module: Megatron-Core runs it after the last layer (one more MoE block,
    its eh_proj and the shared head), so the step takes longer, the EP exchange covers 59 MoE blocks instead of 58 and
    MFU counts its FLOPs; transformers builds none, so on an HF backend the model times as if it had none."""
    model = load_model_spec("deepseek-v3")
    without = model.model_copy(update={"mtp_layers": 0, "name": "deepseek-v3-no-mtp"})
    assert model.mtp_layers == 1 and sum(model.is_moe_layer(i) for i in range(model.num_layers)) == 58
    options = dict(QWEN, global_batch=1024, ep=64)
    mtp, plain = (step_time(m, resolve_plan(m, 256, **options), H100, NETWORK) for m in (model, without))
    assert mtp.compute_s > plain.compute_s
    assert abs(mtp.ep_comm_s / plain.ep_comm_s - 59 / 58) < 1e-9
    megatron = resolve_plan(model, 256, **options)
    assert useful_flops_per_token(model, megatron) == model_flops_per_token(model, 4096, mtp=True) == (
        model_flops_per_token(model, 4096) + 3 * mtp_forward_flops(model, 4096))
    hf = dict(micro_batch=1, global_batch=1024, seq_len=4096, precision="bf16", recompute="none", backend="fsdp")
    fsdp = resolve_plan(model, 256, **hf)
    assert useful_flops_per_token(model, fsdp) == model_flops_per_token(model, 4096)
    assert step_time(model, fsdp, H100, NETWORK) == step_time(without, resolve_plan(without, 256, **hf), H100, NETWORK)


def test_the_overlap_hides_the_all_to_all_behind_the_paired_micro_batch():
    """Megatron-Core's combined 1F1B schedule (overlap_moe_expert_parallel_comm) runs one micro-batch's all-to-alls
    beside another's compute: without a pipeline all but the first forward and the last backward are paired
    ((m-1)/m), interleaved all but the first rank's warm-up, 2(p-1) + (v-1)p + 1 chunks, and its cool-down."""
    from toolkit.estimate.moe_timing import expert_overlap_share

    model = load_model_spec("qwen3-30b-a3b")
    plain, hidden = (_time(model, 16, ep=16, overlap_moe_expert_parallel_comm=flag) for flag in (False, True))
    m = 256 // 16
    share = expert_overlap_share(resolve_plan(model, 16, **{**QWEN, "ep": 16}))
    assert share == (m - 1) / m
    per_micro = (plain.compute_s + plain.moe_overhead_s) / m
    exposed = plain.ep_comm_s / m - min(plain.ep_comm_s / m, per_micro) * share
    assert hidden.ep_comm_s == approx(m * exposed) and hidden.ep_comm_s < plain.ep_comm_s
    assert (hidden.compute_s, hidden.moe_overhead_s) == (plain.compute_s, plain.moe_overhead_s)
    interleaved = resolve_plan(model, 64, **{**QWEN, "ep": 16, "pp": 4, "vpp": 2})
    assert expert_overlap_share(interleaved) == 1 - (2 * 3 + 1 * 4 + 1) / (interleaved.grad_accum * 2)


def test_flex_sends_a_token_across_the_network_once_per_remote_domain():
    """DeepEP / HybridEP (the flex dispatcher) forward a token over NVLink inside each domain holding one of its
    experts, where NCCL's all-to-all sends every copy: EP 16 over two 8-GPU nodes sends 1 - C(64,8)/C(128,8) of a
    token across, not 8 x 8/16 copies; inside one node the two cost the same."""
    import math

    from toolkit.estimate.moe_timing import remote_domains_per_token

    model = load_model_spec("qwen3-30b-a3b")
    plan = resolve_plan(model, 16, **{**QWEN, "ep": 16, "moe_dispatcher": "flex"})
    assert remote_domains_per_token(model, plan, NETWORK) == approx(1 - math.comb(64, 8) / math.comb(128, 8))
    across = {d: _time(model, 16, ep=16, moe_dispatcher=d).ep_comm_s for d in ("alltoall", "flex")}
    assert across["flex"] < across["alltoall"] / 3
    inside = {d: _time(model, 16, ep=8, moe_dispatcher=d).ep_comm_s for d in ("alltoall", "flex")}
    assert inside["flex"] == inside["alltoall"]


def test_every_moe_layer_forward_pays_the_dispatchers_fixed_cost():
    """MOE_LAYER_OVERHEAD_S once per MoE layer forward of every micro-batch, again where the MoE layer is recomputed;
    never for dense layers, nor on the HF backends (no Megatron-Core dispatcher)."""
    from toolkit.estimate.moe_timing import MOE_LAYER_OVERHEAD_S

    model = load_model_spec("qwen3-30b-a3b")  # 48 MoE layers
    t = _time(model, 16, ep=8)
    assert t.moe_overhead_s == approx(48 * (256 // 16) * MOE_LAYER_OVERHEAD_S)
    again = _time(model, 16, ep=8, recompute="selective", recompute_modules="moe")
    assert again.moe_overhead_s == approx(2 * t.moe_overhead_s)
    assert _time(load_model_spec("llama-3.1-8b"), 16).moe_overhead_s == 0.0
    hf = step_time(model, resolve_plan(model, 16, backend="deepspeed", seq_len=4096, global_batch=256), H100, NETWORK)
    assert hf.moe_overhead_s == 0.0


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_group():
    """Megatron-Core reduces the experts' gradients over EDP = world / (pp x ep x etp), whose ranks are ep x etp apart:
    with EP 8 filling each node that is one rank per node, on its own NIC, where the dense gradients' group of 16 runs
    through every NIC of both nodes."""
    from toolkit.backends.megatron.timing import data_parallel_and_optimizer
    from toolkit.estimate.comm import collective_time
    from toolkit.estimate.memory import stage_params
    from toolkit.estimate.params import count_params

    model = load_model_spec("qwen3-30b-a3b")
    plan = resolve_plan(model, 16, **{**QWEN, "ep": 8})
    network = NETWORK.for_plan(plan)
    params = stage_params(model, count_params(model), plan, 0)
    exposed, _, _ = data_parallel_and_optimizer(model, plan, H100, network, 0.0, params.total, params.total)
    dense_link, expert_link = network.link(16, 1), network.link(2, 8)
    assert expert_link.bus_bw < dense_link.bus_bw
    expected = sum(collective_time(op, n * b, group, link) for n, group, link in (
        (params.dense, 16, dense_link), (params.expert, 2, expert_link)) for op, b in (
        ("reduce_scatter", 4), ("all_gather", 2)))
    assert exposed == approx(expected)


def test_fused_attention_prices_narrow_heads_and_sliding_windows_at_their_own_rate():
    """FlashAttention-3's published rates (arXiv:2407.08608 Fig. 5): head dim 64 runs 476 of head dim 128's 638
    TFLOP/s at 4k tokens (between them on log2 of the head dim, head dim 128's rate above it); a sliding window's band
    (GPT-OSS: 128 tokens on half its layers) has no masked half to skip and runs as blocks as short as the window."""
    from toolkit.estimate.attention_rate import fused_attention_work

    assert attention_block_rate(4096, head_dim=64) == approx(476 / 648)
    assert attention_block_rate(4096, head_dim=64) < attention_block_rate(4096, head_dim=96) < attention_block_rate(4096)
    assert attention_block_rate(4096, head_dim=256) == attention_block_rate(4096)
    causal, band = fused_attention_work(4096, 64), fused_attention_work(4096, 64, window=128)
    assert band == approx(2 * causal * attention_block_rate(4096, 64) / attention_block_rate(512, 64))
    assert fused_attention_work(4096, 64, window=8192) == causal  # a window as long as the sequence changes nothing


def test_gpt_oss_experts_pay_their_eager_bias_add_and_the_recomputed_activation():
    """Megatron-Core adds the experts' fc2 bias expert by expert outside the grouped GEMM (TEGroupedMLP._apply_bias,
    12 h elements per routed copy forward and backward) and runs the activation again under moe_act recompute: each
    is memory-bound traffic of the routed copies on top of the permutation's, and each lengthens the step."""
    from toolkit.estimate.moe_timing import routed_token_traffic_bytes

    model = load_model_spec("gpt-oss-120b")
    plain = model.model_copy(update={"expert_bias": False, "name": "gpt-oss-120b-no-expert-bias"})
    options = dict(QWEN, ep=8, global_batch=64)
    plan = resolve_plan(model, 8, **options)
    copies = model.experts_top_k
    assert routed_token_traffic_bytes(model, plan, 1.0) - routed_token_traffic_bytes(plain, plan, 1.0) == (
        copies * 12 * model.hidden_size * 2)
    recomputed = resolve_plan(model, 8, **{**options, "recompute": "selective", "recompute_modules": "moe_act"})
    assert routed_token_traffic_bytes(model, recomputed, 1.0) - routed_token_traffic_bytes(model, plan, 1.0) == (
        copies * 3 * model.moe_ffn_hidden_size * 2)  # fc1's two halves read, the activation written, in bf16
    biased, unbiased = (step_time(m, resolve_plan(m, 8, **options), H100, NETWORK) for m in (model, plain))
    assert biased.compute_s > unbiased.compute_s
