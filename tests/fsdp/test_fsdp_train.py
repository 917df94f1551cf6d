"""FSDP2 on 2 CPU ranks (gloo), through the libraries: `accelerate launch` with the generated accelerate.yaml and
plan.json, and torchrun with `--backend fsdp` (inside `dmt restore-test`). Each run trains the tiny recipe (the loss
falls), writes metrics.jsonl and DCP checkpoints with a manifest, and its parameters were DTensor shards holding half
of every tensor on each rank (sharding.json, written by the post-preparation check; a silent DDP fallback stops that
check, as the last test shows with the libraries alone). Resume is bitwise, and DCP reshards onto one rank. A tiny
Mixtral trains the same way, its experts sharded as ordinary parameters (no expert parallelism)."""

import json
import subprocess

import pytest
from fsdp_helpers import BIN, MOE_FAMILY, MOE_STEPS, PROBE, STEPS, environment

from helpers import TINY_MOE, assert_profiled, assert_step_cost, free_port
from toolkit.backends.fsdp.checkpoint import MANIFEST_FORMAT as FSDP_FORMAT
from toolkit.backends.fsdp.train import SHARDING_FILE
from toolkit.checkpoint.manifest import read_manifest, resolve_latest
from toolkit.checkpoint.verify import verify
from toolkit.runtime.metrics import read_metrics, read_run_record

pytestmark = pytest.mark.launch


def assert_trained(out, steps: int = STEPS) -> list[dict]:
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    prediction = read_run_record(out)
    for record in records:  # what the step cost (the MFU against the host peak where the recipe is planned for it)
        assert_step_cost(record, prediction)
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 1.0, (first, last)  # the tiny corpus is learnable: the loss clearly falls
    latest = resolve_latest(out)
    assert latest is not None and latest.name == f"checkpoint-{steps}"
    report = verify(latest)
    assert report.ok and report.manifest and report.format == "hf-trainer+fsdp", report.problems
    manifest = read_manifest(latest)
    assert manifest["format"] == FSDP_FORMAT and manifest["world_size"] == 2
    assert manifest["layout"]["dp_shard"] == 2 and manifest["layout"]["reshard_after_forward"] is True
    return records


def assert_sharded_in_halves(out) -> dict:
    """Every rank's trainable parameters were DTensors sharded over a mesh of 2, holding half of every byte; its
    gradient shards and Adam states were as large as that half (fp32) and twice it."""
    record = json.loads((out / SHARDING_FILE).read_text())
    assert record["dp_shard"] == 2 and len(record["ranks"]) == 2
    for rank in record["ranks"]:
        assert rank["sharded"] == rank["parameters"] > 0
        assert rank["shard_mesh"] == [2]
        assert rank["local_bytes"] * 2 == rank["global_bytes"]
        assert rank["gradient_bytes"] == rank["local_bytes"]
        assert 2 * rank["local_bytes"] <= rank["optimizer_bytes"] < 2.01 * rank["local_bytes"]  # + `step` scalars
    return record


def test_accelerate_launch_trains_the_generated_files(accelerate_run):
    assert_trained(accelerate_run.out)
    assert accelerate_run.rc == 0, accelerate_run.tail()
    log = accelerate_run.log.read_text()
    assert "Accelerate takes its FSDP path" in log  # the CPU compatibility step, named in the log


def test_parameters_were_dtensor_shards_of_half_each_tensor(accelerate_run):
    assert_sharded_in_halves(accelerate_run.out)


def test_profiled_fsdp_steps_write_traces_and_a_breakdown_that_adds_up(accelerate_run):
    breakdown = assert_profiled(accelerate_run.out)
    # FSDP2's all-gathers and reduce-scatters run on gloo's threads: the profile holds them, overlapped or exposed
    assert max(row["communication_exposed_s"] + row["communication_overlapped_s"] for row in breakdown["steps"]) > 0


def test_checkpoints_are_dcp_shards_of_both_ranks(accelerate_run):
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = accelerate_run.out / f"checkpoint-{STEPS}"
    for directory in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (checkpoint / directory).iterdir()) == [".metadata", "__0_0.distcp",
                                                                             "__1_0.distcp"]
    metadata = FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0")).read_metadata()
    for key, meta in metadata.state_dict_metadata.items():  # each rank saved its own half of every tensor
        assert [tuple(c.sizes)[0] * 2 for c in meta.chunks] == [meta.size[0]] * 2, key
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "llama"
    assert (accelerate_run.out / f"checkpoint-{STEPS // 2}" / "dmt_manifest.json").is_file()


def test_torchrun_backend_fsdp_trains_and_resumes_to_the_bit(torchrun_restore):
    workdir, result = torchrun_restore
    assert_trained(workdir / "reference")
    assert_sharded_in_halves(workdir / "reference")
    assert result["passed"] and result["identical"], result["mismatches"]
    assert result["killed_at_step"] >= STEPS // 2 and result["checkpoint"].endswith(f"checkpoint-{STEPS // 2}")


def test_moe_experts_train_as_dtensor_shards_and_resume_resharded_on_one_rank(moe_reshard):
    """The tiny Mixtral on 2 ranks: the loss falls; every parameter, the fused [experts, ...] tensors included, was a
    DTensor holding half of it (sharding.json), and each rank saved half of every expert tensor, two whole experts
    (dim 0) each. No expert parallelism: FSDP2 gathers them all for each forward. Its checkpoint resumes on one rank
    (DCP reshards) within the stated tolerance."""
    from torch.distributed.checkpoint import FileSystemReader

    workdir, result = moe_reshard
    reference = workdir / "reference"
    assert_trained(reference, MOE_STEPS)
    assert_sharded_in_halves(reference)
    metadata = FileSystemReader(str(reference / f"checkpoint-{MOE_STEPS}" / "pytorch_model_fsdp_0")).read_metadata()
    experts = {key: meta for key, meta in metadata.state_dict_metadata.items() if ".mlp.experts." in key}
    assert len(experts) == 2 * TINY_MOE[MOE_FAMILY]["num_hidden_layers"], sorted(metadata.state_dict_metadata)
    for key, meta in experts.items():
        assert meta.size[0] == TINY_MOE[MOE_FAMILY]["num_local_experts"] and len(meta.size) == 3, key
        assert sorted((tuple(c.offsets)[0], tuple(c.sizes)[0]) for c in meta.chunks) == [(0, 2), (2, 2)], key
    assert result["passed"], result["mismatches"]
    assert result["tolerance"] == pytest.approx(1e-3) and result["max_abs_diff"] <= 1e-3
    manifest = read_manifest(workdir / "interrupted" / f"checkpoint-{MOE_STEPS}")
    assert manifest["world_size"] == 1 and manifest["layout"]["dp_shard"] == 1


def test_without_the_compatibility_step_accelerate_trains_ddp_and_the_check_stops_it(fsdp_generated, tmp_path):
    """The libraries alone, as Wave 2 found them: an FSDP accelerate.yaml on CPU ranks gives MULTI_CPU and DDP."""
    out = tmp_path / "probe.json"
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(fsdp_generated / "accelerate.yaml"),
           "--main_process_port", str(free_port()), str(PROBE), str(fsdp_generated / "plan.json"), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=environment(), timeout=600)
    assert out.is_file(), result.stdout[-3000:] + result.stderr[-3000:]
    probe = json.loads(out.read_text())
    assert probe["distributed_type"] == "DistributedType.MULTI_CPU" and probe["fsdp_enabled"] is False
    assert probe["model"] == "DistributedDataParallel"
    assert probe["check"].startswith("fsdp: after preparation 21 of 21 parameters are not FSDP2 shards")
