"""Every prediction is bounded by the hardware: no plan, however long its sequences or many its GPUs, is predicted
above the share of the catalogue peak the model allows (MFU <= the best GEMM efficiency), and measured bandwidths
never make a step faster than the datasheet's."""

import json

import pytest

from toolkit.cli.main import main
from toolkit.estimate.efficiency import PEAK_EFFICIENCY

CASES = [  # (model, gpus, extra flags): dense, GQA, MoE; one GPU to 16,384; 128 tokens to 10M
    ("llama-3.1-8b", 1, ["--seq-len", "128"]),
    ("llama-3.1-8b", 8, ["--seq-len", "10000000"]),
    ("llama-3.1-8b", 8, ["--seq-len", "1000000", "--backend", "megatron", "--cp", "8"]),
    ("llama-3.1-70b", 1024, ["--seq-len", "131072", "--backend", "megatron", "--tp", "8", "--cp", "16"]),
    ("llama-3.1-405b", 16384, ["--seq-len", "8192", "--backend", "megatron", "--tp", "8", "--pp", "16",
                               "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                               "--global-batch", "2048", "--recompute", "full"]),
    ("mixtral-8x7b", 64, ["--seq-len", "4194304", "--backend", "megatron", "--ep", "8", "--cp", "8"]),
    ("gpt2", 16384, ["--seq-len", "1024", "--zero", "3"]),
]


def _json(capsys, *argv):
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model, gpus, flags", CASES, ids=[f"{m}-{g}-{f[1]}" for m, g, f in CASES])
def test_no_estimate_exceeds_what_the_gemms_allow(capsys, model, gpus, flags):
    report = _json(capsys, "estimate", "--model", model, "--gpus", str(gpus), *flags)
    assert 0 < report["mfu"] <= PEAK_EFFICIENCY, report["mfu"]
    assert report["tflops_per_gpu"] * 1e12 <= PEAK_EFFICIENCY * 989.5e12 * (1 if "h100" in report["gpu"] else 2)
    assert report["step_time_s"] > 0 and report["tokens_per_s"] > 0


def test_no_ranked_plan_at_128k_exceeds_what_the_gemms_allow(capsys):
    plans = _json(capsys, "plan", "--model", "llama-3.1-8b", "--gpus", "64", "--seq-len", "131072",
                  "--global-batch", "64", "--top", "50")["plans"]
    assert plans and max(p["mfu"] for p in plans) <= PEAK_EFFICIENCY


def _health_report(tmp_path, intra, inter):
    path = tmp_path / "health.json"
    path.write_text(json.dumps({"bandwidth": {"intra_node_busbw_gbps": intra, "inter_node_busbw_gbps": inter}}))
    return path


def test_an_unmeasured_tier_keeps_the_datasheet_and_a_zero_bandwidth_is_refused(capsys, tmp_path):
    argv = ["estimate", "--model", "llama-3.1-70b", "--gpus", "64", "--zero", "3"]
    datasheet = _json(capsys, *argv)["step_time_s"]
    # one node measured: no inter-node figure; the inter-node ZeRO-3 traffic must not get faster than the datasheet
    one_node = _json(capsys, *argv, "--measured-bw", str(_health_report(tmp_path, 450.0, None)))["step_time_s"]
    assert one_node >= datasheet
    for bad in (0, -5, "fast"):
        assert main([*argv, "--measured-bw", str(_health_report(tmp_path, 450.0, bad))]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "bandwidth.inter_node_busbw_gbps must be a positive number" in err
