"""The memory model's model-state arithmetic against the ZeRO paper, Megatron's table and DeepSpeed's estimators."""

import pytest

from toolkit.errors import UserInputError
from toolkit.estimate.memory import estimate_memory, estimate_stage_memory, stage_layers, stage_params
from toolkit.estimate.params import count_params
from toolkit.spec.engine_settings import megatron_padded_vocab
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import resolve_plan

# A dense llama-shaped model whose vocabulary is already a multiple of 128 x 8 (no Megatron padding).
DENSE = ModelSpec(
    name="dense", num_layers=8, hidden_size=1024, num_attention_heads=16, num_kv_heads=4, head_dim=64,
    ffn_hidden_size=2816, vocab_size=32768,
)
PSI = count_params(DENSE).total


def _states(mem):
    return mem.weights + mem.gradients + mem.optimizer


@pytest.mark.parametrize("zero, expected", [
    (0, 2 * PSI + 2 * PSI + 12 * PSI),
    (1, 2 * PSI + (2 + 12) * PSI / 8),  # DeepSpeed's ZeRO-1 keeps only its gradient partition (see memory.py)
    (2, 2 * PSI + (2 + 12) * PSI / 8),
    (3, (2 + 2 + 12) * PSI / 8),
])
def test_zero_stages_follow_the_zero_paper(zero, expected):
    """(2 + 2 + K) x Psi with K = 12, divided as ZeRO-1/2/3 partition it (fp16 mixed precision).

    Measured on real 2-rank runs, DeepSpeed's ZeRO-1 holds gradients partitioned like ZeRO-2 (contiguous_gradients),
    one step tighter than the paper's P_os."""
    plan = resolve_plan(DENSE, 8, zero=zero, precision="fp16", seq_len=128)
    assert _states(estimate_memory(DENSE, plan)) == pytest.approx(expected, rel=1e-6)


def test_megatron_distributed_optimizer_bytes_per_param():
    """Megatron-LM dist_optimizer.md: bf16 params, fp32 grads -> 18 bytes, or 6 + 12/d with the distributed optimizer."""
    plain = resolve_plan(DENSE, 8, backend="megatron", seq_len=128)
    dist = resolve_plan(DENSE, 8, backend="megatron", distributed_optimizer=True, seq_len=128)
    assert _states(estimate_memory(DENSE, plain)) == 18 * PSI
    assert _states(estimate_memory(DENSE, dist)) == pytest.approx((6 + 12 / 8) * PSI, rel=1e-6)


def test_deepspeed_zero2_estimator_differs_only_by_the_step_time_fp32_gradients():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, ds_gpu = estimate_zero2_model_states_mem_needs(PSI, num_gpus_per_node=8, num_nodes=1, cpu_offload=False)
    ours = _states(estimate_memory(DENSE, resolve_plan(DENSE, 8, zero=2, seq_len=128)))
    # DeepSpeed keeps "4_grads_32bit" per parameter partition permanently; we count it only at step time.
    assert ours + 4 * PSI // 8 == pytest.approx(ds_gpu, rel=1e-6)


def test_deepspeed_zero3_estimator_agrees_on_partitions_and_live_layers():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    largest_layer = max(layer.total for layer in count_params(DENSE).layers)
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
        PSI, largest_layer, num_gpus_per_node=8, num_nodes=1, cpu_offload=False, cpu_offload_params=False
    )
    mem = estimate_memory(DENSE, resolve_plan(DENSE, 8, zero=3, seq_len=128))
    live = mem.overhead_detail["stage3_live_params"]
    assert live == 4 * largest_layer  # two gathered layers in bf16 == DeepSpeed's 4 bytes x largest layer
    # DeepSpeed budgets 18 bytes/param/N (it adds a 2-byte allowance); we count 2 + 2 + 12.
    assert _states(mem) + live + 2 * PSI / 8 == pytest.approx(ds_gpu, rel=1e-6)


def test_offload_moves_optimizer_to_host():
    on_gpu = estimate_memory(DENSE, resolve_plan(DENSE, 8, zero=3, seq_len=128))
    offloaded = estimate_memory(DENSE, resolve_plan(DENSE, 8, zero=3, offload_optimizer="cpu", offload_params="cpu", seq_len=128))
    assert offloaded.optimizer == 0 and offloaded.weights == 0
    assert offloaded.host_bytes == pytest.approx(on_gpu.optimizer + on_gpu.weights + 4 * PSI / 8, rel=1e-6)


def test_pipeline_stages_partition_the_layers_and_tied_heads_keep_a_copy():
    plan = resolve_plan(DENSE, 8, pp=4, vpp=2, backend="megatron", seq_len=128, global_batch=16)
    held = [stage_layers(DENSE.num_layers, plan, s) for s in range(4)]
    assert sorted(i for layers in held for i in layers) == list(range(8))
    assert held[0] == [0, 4]  # interleaved: rank 0 holds model chunks 0 and 4
    counts = count_params(DENSE)
    pipeline = resolve_plan(DENSE, 4, pp=4, seq_len=128, backend="megatron")
    assert sum(stage_params(DENSE, counts, pipeline, s).total for s in range(4)) == counts.total  # no vocab padding
    tied = DENSE.model_copy(update={"tie_embeddings": True})
    tied_counts = count_params(tied)
    total = sum(stage_params(tied, tied_counts, pipeline, s).total for s in range(4))
    assert total == tied_counts.total + tied_counts.token_embedding


def test_tensor_parallel_shards_matrices_and_pads_vocab():
    counts = count_params(DENSE)
    tp1 = stage_params(DENSE, counts, resolve_plan(DENSE, 8, backend="megatron", seq_len=128), 0)
    tp4 = stage_params(DENSE, counts, resolve_plan(DENSE, 8, backend="megatron", tp=4, seq_len=128), 0)
    assert tp4.total < tp1.total / 3.5
    assert megatron_padded_vocab(50257, 2) == 50432  # GPT-2 in Megatron-LM: 50257 -> 50432 at TP=2
    assert megatron_padded_vocab(32768, 8) == 32768


def test_first_pipeline_stage_holds_pp_microbatches_in_flight():
    one = estimate_stage_memory(DENSE, resolve_plan(DENSE, 4, pp=4, seq_len=256, global_batch=8, backend="megatron"), 1)
    gas1 = estimate_stage_memory(DENSE, resolve_plan(DENSE, 4, pp=4, seq_len=256, global_batch=1, backend="megatron"), 1)
    # stage 1 of 4 keeps 3 micro-batches when there are enough of them, 1 when there is only 1
    assert one.activations == pytest.approx(3 * gas1.activations, rel=1e-9)


def test_recompute_reduces_activations_in_the_documented_order():
    # Megatron-Core's unfused (local) attention keeps the s x s scores that selective recompute drops (the plan's
    # `attention` names the HF models' kernels)
    kwargs = dict(backend="megatron", tp=2, seq_len=2048, transformer_impl="local")
    none = estimate_memory(DENSE, resolve_plan(DENSE, 8, **kwargs)).activations
    selective = estimate_memory(DENSE, resolve_plan(DENSE, 8, recompute="selective", **kwargs)).activations
    full = estimate_memory(DENSE, resolve_plan(DENSE, 8, recompute="full", **kwargs)).activations
    assert full < selective < none
    kwargs["transformer_impl"] = "transformer_engine"
    none = estimate_memory(DENSE, resolve_plan(DENSE, 8, **kwargs)).activations
    sp = estimate_memory(DENSE, resolve_plan(DENSE, 8, sequence_parallel=True, **kwargs)).activations
    assert sp < none


def test_moe_experts_shard_over_expert_parallel_ranks():
    moe = DENSE.model_copy(update={"num_experts": 8, "experts_top_k": 2, "moe_ffn_hidden_size": 1024})
    counts = count_params(moe)
    ep1 = stage_params(moe, counts, resolve_plan(moe, 8, backend="megatron", seq_len=128), 0)
    ep8 = stage_params(moe, counts, resolve_plan(moe, 8, backend="megatron", ep=8, seq_len=128), 0)
    assert ep1.dense == ep8.dense and ep8.expert * 8 == ep1.expert
    assert counts.active < counts.total


def test_moe_routed_activations_scale_with_the_imbalance_up_to_ep():
    """The busiest expert rank keeps k x the imbalance copies of its tokens' expert activations, never more than
    its EP group routes (ep x the mean); the router and the permutation do not grow with it."""
    from toolkit.estimate.activations import moe_bytes_per_token
    from toolkit.estimate.memory import activation_setup

    moe = DENSE.model_copy(update={"num_experts": 8, "experts_top_k": 2, "moe_ffn_hidden_size": 1024})
    terms = {}
    for ep, imbalance in ((4, 1.0), (4, 1.5), (4, 9.0), (1, 9.0)):
        plan = resolve_plan(moe, 8, backend="megatron", ep=ep, seq_len=1024, moe_imbalance=imbalance)
        terms[ep, imbalance] = moe_bytes_per_token(moe, activation_setup(moe, plan))
    assert terms[4, 1.5]["routed_experts"] == pytest.approx(1.5 * terms[4, 1.0]["routed_experts"])
    assert terms[4, 9.0]["routed_experts"] == pytest.approx(4 * terms[4, 1.0]["routed_experts"])  # capped at ep
    assert terms[1, 9.0]["routed_experts"] == terms[4, 1.0]["routed_experts"]  # one rank holds every copy anyway
    assert terms[4, 9.0]["router"] == terms[4, 1.0]["router"] > 0
    balanced = estimate_memory(moe, resolve_plan(moe, 8, backend="megatron", ep=4, seq_len=1024)).activations
    skewed = estimate_memory(moe, resolve_plan(moe, 8, backend="megatron", ep=4, seq_len=1024,
                                               moe_imbalance=1.5)).activations
    assert skewed > balanced


def test_moe_recompute_modules_remove_what_they_checkpoint():
    from toolkit.estimate.activations import moe_bytes_per_token
    from toolkit.estimate.memory import activation_setup

    moe = DENSE.model_copy(update={"num_experts": 8, "experts_top_k": 2, "moe_ffn_hidden_size": 1024})
    setup = activation_setup(moe, resolve_plan(moe, 8, backend="megatron", ep=4, seq_len=1024))
    a, ffn = setup.act_bytes, 1024
    full = moe_bytes_per_token(moe, setup)
    act = moe_bytes_per_token(moe, setup.__class__(**{**setup.__dict__, "recompute_modules": ("moe_act",)}))
    whole = moe_bytes_per_token(moe, setup.__class__(**{**setup.__dict__, "recompute_modules": ("moe",)}))
    # k copies of fc2's input on the busiest rank (the default imbalance's share)
    assert full["routed_experts"] - act["routed_experts"] == pytest.approx(2 * setup.routed_factor * a * ffn)
    assert sum(whole.values()) == 0


def test_expert_weights_split_over_ep_x_etp_under_folding():
    moe = DENSE.model_copy(update={"num_experts": 8, "experts_top_k": 2, "moe_ffn_hidden_size": 1024})
    counts = count_params(moe)
    options = dict(backend="megatron", tp=2, ep=4, seq_len=128, sequence_parallel=True)
    unfolded = stage_params(moe, counts, resolve_plan(moe, 8, **options), 0)
    folded = stage_params(moe, counts, resolve_plan(moe, 8, etp=1, **options), 0)
    assert folded.dense == unfolded.dense and folded.expert == 2 * unfolded.expert


@pytest.mark.parametrize("options, flag", [
    (dict(tp=3), "--tp"),
    (dict(pp=3), "--pp"),
    (dict(tp=2, pp=2, gpus=6), "--gpus"),
    (dict(global_batch=12, micro_batch=1, gpus=8), "--global-batch"),
    (dict(zero=2, pp=2), "--pp"),  # the HF Trainer cannot run DeepSpeed's pipeline engine
    (dict(zero=2, tp=2), "--tp"),  # no DeepSpeed AutoTP through the HF Trainer
    (dict(zero=3, offload_optimizer="nvme"), "--nvme-path"),
    (dict(micro_batch=0), "--micro-batch"),
    (dict(ep=2), "--ep"),
    (dict(backend="megatron", zero=1), "--zero"),
    (dict(backend="megatron", sequence_parallel=True), "--sequence-parallel"),
    (dict(vpp=2), "--vpp"),
])
def test_invalid_plans_name_the_flag(options, flag):
    gpus = options.pop("gpus", 8)
    with pytest.raises(UserInputError) as err:
        resolve_plan(DENSE, gpus, **options)
    assert err.value.key == flag


@pytest.mark.parametrize("backend, reason", [("deepspeed", "AutoEP does not run with transformers 5.23"),
                                             ("fsdp", "no expert-parallel axis")])
def test_hf_backends_refuse_expert_parallelism_saying_why(backend, reason):
    """HF Trainer trains an MoE model's experts sharded as ordinary parameters: EP is refused in one line that says
    why the pinned libraries' own mechanisms do not apply (read and run here: backends/*/rules.py EP_REFUSAL)."""
    moe = DENSE.model_copy(update={"num_experts": 8, "experts_top_k": 2, "moe_ffn_hidden_size": 1024})
    extra = {"dp_shard": 8} if backend == "fsdp" else {}
    resolve_plan(moe, 8, backend=backend, seq_len=128, **extra)  # at EP 1 the plan stands
    with pytest.raises(UserInputError) as refused:
        resolve_plan(moe, 8, backend=backend, ep=2, seq_len=128, **extra)
    assert refused.value.key == "--ep" and reason in refused.value.message and "\n" not in refused.value.message


def test_megatron_keeps_the_mtp_modules_on_the_last_stage():
    from toolkit.spec.model import load_model_spec

    model = load_model_spec("deepseek-v3")
    assert model.mtp_layers and model.mla
    counts = count_params(model)
    options = dict(pp=4, first_stage_layers=16, ep=32, seq_len=1024)
    megatron = resolve_plan(model, 256, backend="megatron", **options)
    last = stage_params(model, counts, megatron, 3)
    without = stage_params(model.model_copy(update={"mtp_layers": 0}), count_params(
        model.model_copy(update={"mtp_layers": 0})), megatron, 3)
    block = counts.mtp_layers[0]
    assert last.total - without.total == block.total - block.experts + block.experts // 32 + counts.mtp_eh_proj + counts.mtp_norms
    assert last.expert > without.expert and last.dense > without.dense
    assert estimate_stage_memory(model, megatron, 3).activations > estimate_stage_memory(
        model.model_copy(update={"mtp_layers": 0}), megatron, 3).activations


def test_mla_up_projection_recompute_drops_the_up_projected_q_k_v():
    from toolkit.estimate.activations import _attention_bytes
    from toolkit.estimate.memory import activation_setup
    from toolkit.spec.model import load_model_spec

    model = load_model_spec("deepseek-v3")
    setup = activation_setup(model, resolve_plan(model, 256, backend="megatron", pp=4, first_stage_layers=16, ep=32,
                                                 seq_len=1024))
    kept = _attention_bytes(model, 2, setup)
    recomputed = _attention_bytes(model, 2, setup.__class__(**{**setup.__dict__, "recompute_modules": ("mla_up_proj",)}))
    heads = model.num_attention_heads
    assert kept - recomputed == 2 * heads * (2 * model.head_dim + model.value_head_dim)
    from toolkit.estimate.activations import mla_compressed_bytes
    assert mla_compressed_bytes(model, 2, setup) > 2 * 2 * model.kv_lora_rank  # the latents stay, counted apart
