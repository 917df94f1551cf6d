"""Step time per execution path (toolkit/estimate/efficiency.py) and the network model that goes with it."""

import pytest

from toolkit.estimate.comm import ACHIEVABLE_BUS_FRACTION, Network
from toolkit.estimate.efficiency import EXECUTION_PATHS, HF, MEGATRON_LOCAL, MEGATRON_TE, execution_path
from toolkit.estimate.timing import step_time
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

H100 = get_gpu("h100-80gb")
NETWORK = Network.from_catalogue(H100, 8)
LLAMA_1B = load_model_spec("llama-3.2-1b")


def _step(backend: str, **options) -> float:
    plan = resolve_plan(LLAMA_1B, 1, backend=backend, seq_len=options.pop("seq_len", 2048), **options)
    return step_time(LLAMA_1B, plan, H100, NETWORK)


def _plan(backend: str, **options):
    return resolve_plan(LLAMA_1B, 1, backend=backend, **options)


def test_each_backend_trains_on_its_own_execution_path():
    """The plan's backend names its execution path (toolkit/backends/<name>/timing.py execution_path)."""
    assert execution_path(_plan("deepspeed")) is HF
    assert execution_path(_plan("fsdp")) is HF
    assert execution_path(_plan("megatron")) is MEGATRON_TE  # Transformer Engine unless the plan says local
    assert execution_path(_plan("megatron", transformer_impl="transformer_engine")) is MEGATRON_TE
    assert execution_path(_plan("megatron", transformer_impl="local")) is MEGATRON_LOCAL
    assert set(EXECUTION_PATHS) == {"hf", "megatron-te", "megatron-local"}
    assert _step("deepspeed", zero=2, micro_batch=4, global_batch=4).execution_path == "hf"
    assert _step("megatron", micro_batch=1, global_batch=4, transformer_impl="local").execution_path == "megatron-local"


def test_the_same_layout_is_slower_on_hf_modules_than_on_transformer_engine():
    """One GPU, one micro-batch of 4 x 2048: no communication, so the paths' rates alone separate them."""
    te = _step("megatron", micro_batch=4, global_batch=4)
    hf = _step("fsdp", micro_batch=4, global_batch=4)
    assert hf.compute_s == pytest.approx(te.compute_s / HF.compute_scale, rel=1e-9)
    assert hf.mfu < te.mfu


def test_local_spec_pays_for_the_score_matrix_quadratically():
    """The unfused attention moves heads x s scores per token: doubling s more than doubles what it adds per token."""
    extra = {}
    for seq in (1024, 2048):
        local = _step("megatron", micro_batch=1, global_batch=4, seq_len=seq, transformer_impl="local")
        te_at_eager_rate = step_time(LLAMA_1B, resolve_plan(LLAMA_1B, 1, backend="megatron", micro_batch=1,
                                                             global_batch=4, seq_len=seq), H100, NETWORK, HF)
        extra[seq] = (local.compute_s - te_at_eager_rate.compute_s) / seq  # per token
    assert extra[1024] > 0
    assert extra[2048] > 1.8 * extra[1024]


@pytest.mark.parametrize("case, measured_s, options", [
    ("DeepSpeed ZeRO-2, HF Trainer", 0.254, dict(backend="deepspeed", zero=2, micro_batch=4, global_batch=4)),
    ("Megatron-Core local spec", 0.539, dict(backend="megatron", transformer_impl="local", micro_batch=1,
                                              global_batch=4)),
])
def test_execution_paths_reproduce_the_toolkits_own_h100_runs(case, measured_s, options):
    """benchmarks/gpu_check.md, Llama 3.2 1B on one H100 at seq 2048 (the DeepSpeed run is one of the two the eager
    rate was fitted on; the local spec's is predicted, not fitted)."""
    assert _step(**options).total_s == pytest.approx(measured_s, rel=0.08), case


def test_rings_across_nodes_use_every_nic_but_all_to_all_only_its_own():
    nic = NETWORK.inter_node_bw_gbps * 1e9 * ACHIEVABLE_BUS_FRACTION
    size = 1e9
    # 16 ranks, 8 per node: half of each rank's all-to-all data is for the other node, through its own NIC
    assert NETWORK.all_to_all_time(size, 16, 1) == pytest.approx(8 / 16 * size / nic + 15 * 10e-6)
    # one rank per node: every byte but its own share crosses
    assert NETWORK.all_to_all_time(size, 4, 8) == pytest.approx(3 / 4 * size / nic + 3 * 10e-6)
    # inside a node: NVLink only
    inside = NETWORK.all_to_all_time(size, 8, 1)
    assert inside == pytest.approx(7 / 8 * size / (NETWORK.intra_node_bw_gbps * 1e9 * ACHIEVABLE_BUS_FRACTION)
                                   + 7 * 5e-6)
    assert NETWORK.all_to_all_time(size, 1, 1) == 0.0


def test_yarn_attention_factor_runs_rotary_eagerly_on_the_fused_execution_path():
    """GPT-OSS's YaRN attention factor (0.1 ln 32 + 1) is not 1, which Transformer Engine's fused RoPE cannot take, so
    Megatron-Core applies rotary to its 64 + 8 heads of 64 eagerly: 22 elements moved per element, forward and
    backward, on every layer. The eager execution paths' rate carries their own unfused rotary already."""
    from toolkit.estimate.efficiency import unfused_rotary_elements

    model = load_model_spec("gpt-oss-120b")
    assert model.rope_attention_factor == pytest.approx(1.3466, abs=1e-4)
    plain = model.model_copy(update={"rope_attention_factor": 1.0, "name": "gpt-oss-120b-fused-rope"})
    assert unfused_rotary_elements(model, MEGATRON_TE) == (12 * 72 * 64, 10 * 72 * 64)
    assert unfused_rotary_elements(plain, MEGATRON_TE) == unfused_rotary_elements(model, HF) == (0, 0)
    options = dict(backend="megatron", ep=8, seq_len=4096, global_batch=64, micro_batch=1)
    yarn, fused = (step_time(m, resolve_plan(m, 8, **options), H100, NETWORK) for m in (model, plain))
    assert yarn.compute_s > fused.compute_s
    assert load_model_spec("deepseek-v3").rope_attention_factor == 1.0  # its mscale over mscale_all_dim is 1
