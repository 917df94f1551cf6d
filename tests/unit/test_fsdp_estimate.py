"""The fsdp backend in the plan, the memory model and the step time, with no process group: its options declared once
(flags, recipe keys, rules naming the flag), the FSDP2 byte rules, HSDP and offload, and the overlap calibrated on
torchtitan's published Llama 3.1 8B FSDP runs."""

import argparse
import json

import pytest

from toolkit.backends.fsdp.memory import fsdp_groups
from toolkit.backends.fsdp.timing import fsdp_communication
from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.estimate.comm import Network
from toolkit.estimate.params import count_params
from toolkit.planner.predict import plan_label
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

LLAMA_8B = load_model_spec("llama-3.1-8b")


def test_defaults_shard_over_every_data_parallel_rank():
    plan = resolve_plan(LLAMA_8B, 16, backend="fsdp")
    assert (plan.dp_shard, plan.dp_replicate, plan.reshard_after_forward, plan.zero) == (16, 1, True, 0)
    hsdp = resolve_plan(LLAMA_8B, 16, backend="fsdp", dp_replicate=2)
    assert (hsdp.dp, hsdp.dp_shard, hsdp.dp_replicate) == (16, 8, 2)
    assert plan_label(hsdp) == "fsdp dp16 tp1 pp1 shard8 rep2 mb1 rc=none"
    deepspeed = resolve_plan(LLAMA_8B, 16)
    assert deepspeed.dp_shard is None and deepspeed.reshard_after_forward is None  # nothing of FSDP's elsewhere


@pytest.mark.parametrize("options, key, says", [
    (dict(zero=2), "--zero", "is a DeepSpeed option"),
    (dict(pp=2), "--pp", "pipeline parallelism is not part of the fsdp backend"),
    (dict(recompute="selective"), "--recompute", "use none or full with fsdp"),
    (dict(offload_params="nvme"), "--offload-params", "cpu memory only"),
    (dict(offload_optimizer="cpu"), "--offload-optimizer", "use --offload-params cpu"),
    (dict(dp_shard=3), "--dp-shard", "must equal the data-parallel ranks gpus / tp = 16"),
    (dict(dp_replicate=16), "--dp-replicate", "FSDP2 has nothing to shard over"),
    (dict(sequence_parallel=True), "--sequence-parallel", "is a Megatron-Core option"),
    (dict(precision="fp4"), "--precision", "Accelerate has no fp4 recipe"),
    (dict(precision="fp8", fp8_recipe="blockwise"), "--fp8-recipe", "Accelerate's FP8 has no blockwise recipe"),
])
def test_rules_name_the_flag_at_fault(options, key, says):
    with pytest.raises(UserInputError) as caught:
        resolve_plan(LLAMA_8B, 16, backend="fsdp", **options)
    assert caught.value.key == key and says in caught.value.message


def test_fsdp_options_are_refused_by_the_other_backends():
    with pytest.raises(UserInputError, match="is an FSDP2 option; use --backend fsdp"):
        resolve_plan(LLAMA_8B, 16, backend="megatron", reshard_after_forward=False)


def test_the_switch_and_its_no_form_round_trip_through_flags():
    from toolkit.cli.options import add_plan_flags, option_argv, plan_overrides

    parser = argparse.ArgumentParser()
    add_plan_flags(parser)
    given = plan_overrides(parser.parse_args(["--backend", "fsdp", "--no-reshard-after-forward", "--dp-shard", "4"]))
    assert given == {"backend": "fsdp", "dp_shard": 4, "reshard_after_forward": False}
    assert option_argv(given) == ["--backend", "fsdp", "--dp-shard", "4", "--no-reshard-after-forward"]
    assert plan_overrides(parser.parse_args(option_argv(given))) == given


def test_explore_offers_the_switch_as_unset_on_or_off(tmp_path):
    from toolkit.explore.form import form_fields, request_argv

    field = next(f for f in form_fields("estimate") if f["key"] == "reshard_after_forward")
    assert field["kind"] == "select" and field["choices"] == ["true", "false"]
    argv = request_argv("estimate", {"model": "llama-3.1-8b", "reshard_after_forward": "false"}, tmp_path)
    assert "--no-reshard-after-forward" in argv


def _estimate(capsys, *flags: str) -> dict:
    capsys.readouterr()
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "16", "--backend", "fsdp", "--seq-len", "4096",
                 *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_is_fp32_shards_gathered_groups_and_host_offload(capsys):
    params = count_params(LLAMA_8B).total
    full = _estimate(capsys)
    mem = full["memory_bytes"]
    assert mem["weights"] == mem["gradients"] == pytest.approx(4 * params / 16, rel=1e-6)
    assert mem["optimizer"] == pytest.approx(8 * params / 16, rel=1e-6)  # AdamW moments: fp32 shards are the master
    layer = max(layer.total for layer in count_params(LLAMA_8B).layers)
    tail = count_params(LLAMA_8B).lm_head + count_params(LLAMA_8B).final_norm
    assert full["overhead_bytes"]["fsdp_gathered_params"] == 2 * (2 * layer + tail)  # bf16: current + prefetched
    kept = _estimate(capsys, "--no-reshard-after-forward")
    assert kept["overhead_bytes"]["fsdp_gathered_params"] == 2 * params  # every layer gathered until its backward
    hsdp = _estimate(capsys, "--dp-replicate", "2")
    assert hsdp["memory_bytes"]["optimizer"] == pytest.approx(2 * mem["optimizer"], rel=1e-6)
    offload = _estimate(capsys, "--offload-params", "cpu")
    assert offload["memory_bytes"]["weights"] == offload["memory_bytes"]["optimizer"] == 0
    assert offload["host_memory_bytes_per_gpu"] == pytest.approx(16 * params / 16, rel=1e-6)
    assert offload["memory_bytes"]["activations"] == mem["activations"]  # HF modules' activations, as deepspeed's


def test_communication_model_rederives_torchtitans_16_node_throughput():
    """torchtitan (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3): Llama 3.1 8B FSDP, local batch
    2 x 8192, 5,762 tokens/s/GPU on 8 H100s and 5,605 on 128 (-2.7%). With the one-node step as the compute, the
    rings over all eight NICs of a node leave ~1% of the 16-node step exposed: the prediction is within 3%."""
    gpu = get_gpu("h100-80gb")
    counts = count_params(LLAMA_8B)
    groups = fsdp_groups(counts, counts.total, max(layer.total for layer in counts.layers), 1)
    step_8 = 2 * 8192 / 5762
    plan = resolve_plan(LLAMA_8B, 128, backend="fsdp", seq_len=8192, micro_batch=2, global_batch=256)
    predicted = 2 * 8192 / (step_8 + fsdp_communication(plan, groups, Network.from_catalogue(gpu, 8), step_8))
    assert predicted == pytest.approx(5605, rel=0.03)
    assert predicted < 5762
    one_node = resolve_plan(LLAMA_8B, 8, backend="fsdp", seq_len=8192, micro_batch=2, global_batch=16)
    assert fsdp_communication(one_node, groups, Network.from_catalogue(gpu, 8), step_8) < 0.01  # NVLink: hidden


def test_hsdp_and_keeping_layers_gathered_change_communication():
    """Keeping layers gathered drops the backward all-gather. HSDP moves the all-gathers and reduce-scatters inside
    the node and all-reduces the shards across replicas through each rank's own NIC: on a rail network (a NIC per
    GPU) full sharding's rings through all eight NICs are as fast, and HSDP's extra intra-node step makes it slower;
    where a node shares one 100 Gb/s NIC, HSDP is the faster."""
    counts = count_params(LLAMA_8B)
    groups = fsdp_groups(counts, counts.total, max(layer.total for layer in counts.layers), 1)
    common = dict(backend="fsdp", seq_len=4096, global_batch=64)
    for network, hsdp_faster in ((Network.from_catalogue(get_gpu("h100-80gb"), 8), False),
                                 (Network(intra_node_bw_gbps=450, inter_node_bw_gbps=12.5 / 8, gpus_per_node=8), True)):
        full = fsdp_communication(resolve_plan(LLAMA_8B, 64, **common), groups, network, 0.0)
        hsdp = fsdp_communication(resolve_plan(LLAMA_8B, 64, dp_replicate=8, **common), groups, network, 0.0)
        kept = fsdp_communication(resolve_plan(LLAMA_8B, 64, reshard_after_forward=False, **common), groups, network,
                                  0.0)
        assert kept < full
        assert (hsdp < full) == hsdp_faster, (network, hsdp, full)


def test_plan_searches_fsdp_next_to_the_other_backends(capsys):
    capsys.readouterr()
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "64",
                 "--top", "1000", "--json"]) == 0
    backends = {r["plan"]["backend"] for r in json.loads(capsys.readouterr().out)["plans"]}
    assert {"fsdp", "deepspeed"} <= backends
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "64",
                 "--backends", "deepspeed,fdsp"]) == 2
    error = capsys.readouterr().err
    assert "--backends: got 'deepspeed,fdsp'; valid: a comma list of deepspeed, megatron, fsdp" in error
