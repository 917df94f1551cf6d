"""Step-time formulas (FLOPs, collectives, bubble) and the plan search's guarantees."""

import json

import pytest

from toolkit.cli.main import main
from toolkit.estimate.comm import ACHIEVABLE_BUS_FRACTION, Link, Network, collective_time
from toolkit.estimate.flops import model_flops_per_token, six_n_flops_per_token
from toolkit.estimate.memory import estimate_memory
from toolkit.estimate.timing import step_time
from toolkit.planner.search import search
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import resolve_plan

GPT = ModelSpec(  # Megatron-LM's GPT block: MHA, 4h GELU MLP, tied head
    name="gpt", num_layers=24, hidden_size=2048, num_attention_heads=16, num_kv_heads=16, head_dim=128,
    ffn_hidden_size=8192, vocab_size=51200, tie_embeddings=True, activation="gelu", norm="layernorm",
    position_embedding="learned", position_embedding_rows=2048,
)
LLAMA = ModelSpec(
    name="llama-ish", num_layers=16, hidden_size=2048, num_attention_heads=16, num_kv_heads=8, head_dim=128,
    ffn_hidden_size=5632, vocab_size=32000,
)
H100 = get_gpu("h100-80gb")
FAST = Network(intra_node_bw_gbps=450, inter_node_bw_gbps=50, gpus_per_node=8)


def test_flops_equal_megatron_equation_without_recompute():
    """arXiv:2104.04473 Eq. 3 counts 96 B s l h^2 (1 + s/6h + V/16lh) with recompute; without it, 72 B s l h^2 (1 + s/6h + V/12lh)."""
    s, l, h, v = 2048, GPT.num_layers, GPT.hidden_size, GPT.vocab_size
    per_token = 72 * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    assert model_flops_per_token(GPT, s) == pytest.approx(per_token, rel=1e-12)


def test_flops_approach_six_n_for_short_sequences():
    # 6N over non-embedding parameters (the untied LM head included); norms are the only difference
    assert model_flops_per_token(LLAMA, 1) == pytest.approx(six_n_flops_per_token(LLAMA), rel=1e-3)


def test_ring_all_reduce_and_gather_costs():
    link = Link(bus_bw=100e9, latency_s=0.0)
    size = 1e9
    assert collective_time("all_reduce", size, 8, link) == pytest.approx(2 * 7 / 8 * size / 100e9)
    assert collective_time("all_gather", size, 8, link) == pytest.approx(7 / 8 * size / 100e9)
    assert collective_time("all_reduce", size, 1, link) == 0.0
    slow = Link(bus_bw=100e9, latency_s=1e-5)
    assert collective_time("all_reduce", 0.0, 8, slow) == 0.0
    assert collective_time("all_reduce", 8.0, 8, slow) == pytest.approx(2 * 7 / 8 * 8 / 100e9 + 14 * 1e-5)


def test_groups_crossing_nodes_use_the_inter_node_link():
    nic = FAST.inter_node_bw_gbps * 1e9 * ACHIEVABLE_BUS_FRACTION
    assert FAST.link(8, 1).bus_bw > FAST.link(16, 1).bus_bw  # 16 ranks span two nodes
    assert FAST.link(2, 8).bus_bw == nic  # stride of a node: one rank per node, its own NIC
    # eight ranks per node: NCCL's rings leave the node through all eight NICs, up to the NVLink rate
    assert FAST.link(16, 1).bus_bw == min(8 * nic, FAST.intra_node_bw_gbps * 1e9 * ACHIEVABLE_BUS_FRACTION)
    assert FAST.link(8, 2).bus_bw == 4 * nic  # four of the group's ranks on each node
    assert FAST.link(16, 1).bus_bw == 8 * nic


@pytest.mark.parametrize("pp, vpp, global_batch", [(4, 1, 16), (4, 2, 16), (2, 1, 64)])
def test_pipeline_bubble_is_p_minus_1_over_v_m(pp, vpp, global_batch):
    # with stages of equal work (a vocabulary of 256: no head to speak of) the bubble is (p-1)/(v m) of the step's
    # micro-batches; the boundary stages' single exchange (vpp 1) is all that differs
    even = LLAMA.model_copy(update={"vocab_size": 256})
    plan = resolve_plan(even, pp, backend="megatron", pp=pp, vpp=vpp, seq_len=2048, global_batch=global_batch)
    t = step_time(even, plan, H100, FAST)
    per_micro = (t.compute_s + t.tp_comm_s + t.cp_comm_s + t.ep_comm_s + t.pp_comm_s) / plan.grad_accum
    assert t.bubble_s / (per_micro * plan.grad_accum) == pytest.approx((pp - 1) / (vpp * plan.grad_accum), rel=0.01)
    # the last stage's head sets the pace, but the fill and drain are the other stages' (test_pipeline_schedule.py)
    plan = resolve_plan(LLAMA, pp, backend="megatron", pp=pp, vpp=vpp, seq_len=2048, global_batch=global_batch)
    t = step_time(LLAMA, plan, H100, FAST)
    per_micro = (t.compute_s + t.tp_comm_s + t.cp_comm_s + t.ep_comm_s + t.pp_comm_s) / plan.grad_accum
    assert t.bubble_s < per_micro * (pp - 1) / vpp


def test_mfu_counts_model_flops_without_recompute():
    base = dict(seq_len=2048, global_batch=64, zero=1)
    plain = step_time(LLAMA, resolve_plan(LLAMA, 8, **base), H100, FAST)
    full = step_time(LLAMA, resolve_plan(LLAMA, 8, recompute="full", **base), H100, FAST)
    assert full.total_s > plain.total_s and full.mfu < plain.mfu
    assert plain.tflops_per_gpu == pytest.approx(plain.mfu * 989, rel=0.02)


def test_recompute_options_trade_time_for_memory_in_megatron_cores_order():
    """Per Megatron-Core option on one layout: against none, selective MLP and the block method save memory and
    cost time, the block method more of both with every layer more, full recomputation the most."""
    base = dict(backend="megatron", tp=2, pp=2, vpp=2, seq_len=4096, global_batch=64, sequence_parallel=True)
    options = [dict(recompute="none"), dict(recompute="selective", recompute_modules="mlp")]
    options += [dict(recompute="full", recompute_num_layers=k) for k in (1, 2, 3)] + [dict(recompute="full")]
    plans = [resolve_plan(LLAMA, 16, **base, **option) for option in options]
    memory = [estimate_memory(LLAMA, plan).activations for plan in plans]
    times = [step_time(LLAMA, plan, H100, FAST).total_s for plan in plans]
    assert memory[0] > memory[1] > memory[-1] and memory[0] > memory[2]
    assert memory[2:] == sorted(memory[2:], reverse=True) and len(set(memory[2:])) == 4
    assert times[0] < times[1] < times[-1] and times[0] < times[2]
    assert times[2:] == sorted(times[2:]) and len(set(times[2:])) == 4
    # every chunk has 4 layers: recomputing all 4 of them with the block method is full recomputation
    block_all = resolve_plan(LLAMA, 16, **base, recompute="full", recompute_num_layers=4)
    assert step_time(LLAMA, block_all, H100, FAST).total_s == pytest.approx(times[-1])
    assert estimate_memory(LLAMA, block_all).activations == memory[-1]


def test_block_method_recomputes_the_first_layers_of_every_model_chunk():
    """16 layers, pp 2, vpp 2: rank 0 builds layers 0-3 and 8-11 (Megatron-Core's chunk layout)."""
    from toolkit.estimate.memory import recomputed_layers

    plan = resolve_plan(LLAMA, 4, backend="megatron", pp=2, vpp=2, global_batch=4, recompute="full",
                        recompute_num_layers=2)
    assert recomputed_layers(LLAMA, plan, 0) == {0, 1, 8, 9}
    assert recomputed_layers(LLAMA, plan, 1) == {4, 5, 12, 13}
    full = plan.model_copy(update=dict(recompute_num_layers=None))
    assert recomputed_layers(LLAMA, full, 0) is None  # every layer


def _search(model=LLAMA, gpus=16, gpu=H100, network=FAST, **fixed):
    fixed.setdefault("seq_len", 4096)
    fixed.setdefault("global_batch", 64)
    return search(model, gpus, gpu, network, **fixed)


def test_search_never_proposes_an_invalid_or_oversized_plan():
    result = _search()
    assert result.ranked and result.considered > len(result.ranked)
    for candidate in result.ranked:
        plan = candidate.plan
        again = resolve_plan(LLAMA, plan.gpus, **{k: v for k, v in plan.as_dict().items() if k not in ("dp", "grad_accum", "gpus")})
        assert again == plan
        assert plan.dp * plan.tp * plan.pp * plan.cp == 16
        assert plan.micro_batch * plan.dp * plan.grad_accum == 64
        assert estimate_memory(LLAMA, plan).total <= H100.memory_bytes
    times = [c.time.total_s for c in result.ranked]
    assert times == sorted(times)


def test_search_recomputes_only_where_the_plan_does_not_fit_without_and_lists_each_plan_once():
    result = _search(gpu=get_gpu("a100-40gb"), backends=("megatron",), seq_len=16384)
    recomputing = [c for c in result.ranked if c.plan.recompute != "none"]
    assert {c.plan.recompute_num_layers is not None for c in recomputing} == {True, False}  # block method among them
    assert any(c.plan.recompute_modules == ("mlp",) for c in recomputing)
    for candidate in recomputing:
        without = candidate.plan.model_copy(update=dict(recompute="none", recompute_modules=(), recompute_num_layers=None))
        assert estimate_memory(LLAMA, without).total > get_gpu("a100-40gb").memory_bytes
    layouts = [c.plan.model_copy(update=dict(recompute="none", recompute_modules=(), recompute_num_layers=None))
               for c in result.ranked]
    assert len(layouts) == len(set(layouts))
    assert result.rejected["slower than the same plan without recomputation"] > 0


def test_winner_reason_names_a_tie_and_rejection_counts_are_never_zero():
    from toolkit.planner.search import why_first_beats_second

    result = _search(backends=("megatron",))
    assert all(count > 0 for count in result.rejected.values())
    first = result.ranked[0]
    assert why_first_beats_second(first, first).startswith("ties with the runner-up")
    assert "faster than the runner-up: " in why_first_beats_second(first, result.ranked[-1])


def test_less_memory_pushes_the_best_plan_to_shard_more():
    roomy = _search(gpu=get_gpu("h100-80gb")).ranked[0]
    tight = _search(gpu=get_gpu("rtx-4090")).ranked[0]
    assert tight.memory.total <= get_gpu("rtx-4090").memory_bytes < roomy.memory.total
    assert tight.time.total_s >= roomy.time.total_s


def test_slow_inter_node_links_keep_heavy_traffic_inside_nodes():
    slow = Network(intra_node_bw_gbps=450, inter_node_bw_gbps=1, gpus_per_node=8)
    best_fast = _search().ranked[0]
    best_slow = _search(network=slow).ranked[0]
    assert best_slow.time.total_s > best_fast.time.total_s
    # the best plan over a slow network spends less time communicating across nodes than the fast-network winner would
    fast_winner_on_slow = step_time(LLAMA, best_fast.plan, H100, slow)
    assert best_slow.time.dp_comm_s + best_slow.time.pp_comm_s <= fast_winner_on_slow.dp_comm_s + fast_winner_on_slow.pp_comm_s


def test_dmt_plan_json_and_measured_bandwidth(capsys, tmp_path):
    spec = tmp_path / "llama.yaml"
    spec.write_text("\n".join(f"{k}: {v}" for k, v in LLAMA.model_dump(exclude={"moe_layers"}).items() if v is not None))
    common = ["plan", "--model", str(spec), "--gpus", "16", "--seq-len", "4096", "--global-batch", "64", "--top", "3", "--json"]
    assert main(common) == 0
    answer = json.loads(capsys.readouterr().out)
    assert set(answer) == {"plans", "rejected", "considered", "calibration"} and answer["calibration"] is None
    assert answer["considered"] > sum(answer["rejected"].values()) and all(answer["rejected"].values())
    records = answer["plans"]
    assert len(records) == 3
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "params", "memory_bytes", "plan", "fits"):
        assert key in records[0]
    health = tmp_path / "health.json"
    health.write_text(json.dumps({"ok": True, "bandwidth": {"intra_node_busbw_gbps": 400, "inter_node_busbw_gbps": 0.5}}))
    assert main(common + ["--measured-bw", str(health)]) == 0
    measured = json.loads(capsys.readouterr().out)["plans"]
    assert measured[0]["step_time_s"] > records[0]["step_time_s"]
    health.write_text("{}")
    assert main(common + ["--measured-bw", str(health)]) == 2
    assert "--measured-bw" in capsys.readouterr().err


def test_dmt_plan_plot_writes_a_png(capsys, tmp_path):
    spec = tmp_path / "llama.yaml"
    spec.write_text("\n".join(f"{k}: {v}" for k, v in LLAMA.model_dump(exclude={"moe_layers"}).items() if v is not None))
    png = tmp_path / "memory.png"
    assert main(["plan", "--model", str(spec), "--gpus", "16", "--seq-len", "4096", "--global-batch", "64",
                 "--top", "4", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "winner:" in out and "rejected:" in out and "MFU" in out


@pytest.mark.parametrize("flag", ["--gpus", "--gpus-per-node", "--seq-len", "--global-batch"])
def test_dmt_plan_refuses_non_positive_sizes_in_one_line(capsys, flag):
    argv = {"--gpus": "8", "--gpus-per-node": "8", "--seq-len": "1024", "--global-batch": "8"}
    argv[flag] = "0"
    assert main(["plan", "--model", "gpt2", *[x for kv in argv.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err


def test_dmt_plan_plot_into_a_missing_directory_is_one_line(capsys, tmp_path):
    png = tmp_path / "missing" / "memory.png"
    assert main(["plan", "--model", "gpt2", "--gpus", "8", "--seq-len", "1024", "--global-batch", "8",
                 "--plot", str(png)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--plot" in err


def test_search_tries_zero3_parameter_offload_and_it_fits_where_nothing_else_does():
    """A model too large for ZeRO-3 alone on one small GPU fits only with parameters and optimizer on the host."""
    big = LLAMA.model_copy(update=dict(name="big", num_layers=128))  # 6.2B: 2 B/param of weights alone is half the GPU
    result = _search(model=big, gpus=1, gpu=get_gpu("rtx-4090"), backends=("deepspeed",), seq_len=1024, global_batch=8)
    assert result.ranked
    assert all(c.plan.zero == 3 and c.plan.offload_params == "cpu" for c in result.ranked)
