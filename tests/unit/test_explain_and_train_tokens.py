"""`dmt estimate --explain` and `--train-tokens` as a user meets them: the numbers behind each component, the
rules of thumb they are held against, and days / GPU-hours for a token budget, with the JSON unchanged otherwise."""

import json
import subprocess
import sys

import pytest

from toolkit.cli.main import main

LLAMA_8B = ["--model", "llama-3.1-8b", "--gpus", "8"]


def _json(capsys, verb, *argv):
    assert main([verb, *argv, "--json"]) in (0, 1)
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("text, tokens", [("15T", 15 * 10**12), ("1.5e12", 1_500_000_000_000), ("300B", 300 * 10**9),
                                          ("2000000", 2_000_000), ("2.5m", 2_500_000)])
def test_train_tokens_reads_suffixes_and_scientific_notation(capsys, text, tokens):
    report = _json(capsys, "estimate", *LLAMA_8B, "--train-tokens", text)
    assert report["training_time"]["tokens"] == tokens


def test_training_time_is_whole_steps_at_the_predicted_step_time(capsys):
    report = _json(capsys, "estimate", *LLAMA_8B, "--seq-len", "8192", "--global-batch", "64", "--train-tokens", "1T")
    t = report["training_time"]
    tokens_per_step = 64 * 8192
    assert t["steps"] == -(-10**12 // tokens_per_step)
    # the failure-free figure (`days` before issue 25); `days` now counts checkpoints and failures too
    assert t["days_compute"] == pytest.approx(t["steps"] * report["step_time_s"] / 86400, rel=1e-12)
    assert t["gpu_hours_compute"] == pytest.approx(t["days_compute"] * 24 * 8, rel=1e-12)
    assert t["days"] > t["days_compute"]
    assert t["gpu_hours"] == pytest.approx(t["days"] * 24 * 8, rel=1e-12)


def test_json_is_unchanged_without_the_new_flags(capsys):
    report = _json(capsys, "estimate", *LLAMA_8B)
    assert "training_time" not in report and "explain" not in report
    plans = _json(capsys, "plan", *LLAMA_8B, "--seq-len", "4096", "--global-batch", "64", "--top", "2")["plans"]
    assert all("training_time" not in record for record in plans)


def test_plan_gives_every_ranked_plan_its_days_and_gpu_hours(capsys):
    plans = _json(capsys, "plan", *LLAMA_8B, "--seq-len", "4096", "--global-batch", "64", "--top", "3",
                  "--train-tokens", "300B")["plans"]
    assert len(plans) == 3
    days = [record["training_time"]["days"] for record in plans]
    assert days == sorted(days)  # ranked by step time, so by days too
    assert main(["plan", *LLAMA_8B, "--seq-len", "4096", "--global-batch", "64", "--train-tokens", "300B"]) == 0
    out = capsys.readouterr().out
    assert "days" in out and "GPU-h" in out


@pytest.mark.parametrize("verb, extra", [("estimate", []), ("plan", ["--seq-len", "4096", "--global-batch", "64"])])
@pytest.mark.parametrize("bad", ["15X", "-3T", "0", "many", "1e400"])
def test_bad_token_budget_exits_2_with_one_line_naming_the_flag(capsys, verb, extra, bad):
    assert main([verb, *LLAMA_8B, *extra, "--train-tokens", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--train-tokens" in err and "Traceback" not in err


def _explain(capsys, *argv) -> dict:
    return {e["component"]: e for e in _json(capsys, "estimate", *argv, "--explain")["explain"]}


def test_explain_states_the_bytes_per_parameter_each_plan_really_pays(capsys):
    # one replica: DeepSpeed ZeRO-1 pays 2 + 2 + 12 = 16; bf16 ZeRO-0 keeps fp32 gradients (18); Megatron fp32 main grads
    zero1 = _explain(capsys, *LLAMA_8B, "--zero", "1")
    assert zero1["model_states"]["bytes_per_param_unsharded"] == pytest.approx(16)
    assert zero1["gradients"]["bytes_per_param"] == pytest.approx(2 / 8, rel=1e-3)  # partitioned at ZeRO-1
    assert zero1["optimizer"]["saving_vs_unsharded"] == pytest.approx(1 - 1 / 8, rel=1e-3)
    assert "not a fixed ~60%" in zero1["optimizer"]["difference"]
    zero0 = _explain(capsys, *LLAMA_8B, "--zero", "0")
    assert zero0["model_states"]["bytes_per_param_unsharded"] == pytest.approx(18)
    assert zero0["gradients"]["bytes_per_param"] == pytest.approx(4)
    megatron = _explain(capsys, *LLAMA_8B, "--backend", "megatron", "--distributed-optimizer")
    assert megatron["model_states"]["bytes_per_param_unsharded"] == pytest.approx(18)
    assert "12 B rule leaves out the fp32 master copy" in megatron["model_states"]["difference"]
    # offload moves the states, it does not change what a parameter costs: 16 B/param, almost none on the GPU
    offload = _explain(capsys, *LLAMA_8B, "--zero", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu")
    assert offload["model_states"]["bytes_per_param_unsharded"] == pytest.approx(16)
    assert offload["model_states"]["bytes_per_param"] < 1 and "offload" in offload["model_states"]["difference"]


def test_explain_numbers_come_from_the_printed_breakdown(capsys):
    report = _json(capsys, "estimate", *LLAMA_8B, "--zero", "3", "--recompute", "full", "--explain")
    entries = {e["component"]: e for e in report["explain"]}
    for key in ("weights", "gradients", "optimizer", "activations", "overhead"):
        assert entries[key]["bytes"] == report["memory_bytes"][key]
        assert entries[key]["source"] and entries[key]["rule"] and entries[key]["rule_of_thumb"]
    assert entries["weights"]["bytes_per_param"] == pytest.approx(report["memory_bytes"]["weights"]
                                                                  / report["params_per_gpu"])
    # full recomputation keeps each layer's 16-bit input: the 2·b·s·h·L rule, plus one layer's working set
    assert entries["activations"]["rule_of_thumb_value"] == 2 * 4096 * 4096 * 32
    assert "2·b·s·h·L rule" in entries["activations"]["difference"]
    assert entries["step_time"]["seconds"] == report["step_time_s"]


def test_explain_of_a_token_budget_compares_with_6nd_at_peak(capsys):
    entries = _explain(capsys, *LLAMA_8B, "--train-tokens", "1T")
    t = entries["training_time"]
    assert 0 < t["days_at_peak"] < t["days"]


def test_explain_text_is_whole_through_a_pipe():
    result = subprocess.run([sys.executable, "-m", "toolkit", "estimate", *LLAMA_8B, "--explain", "--train-tokens",
                             "15T"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Why these numbers" in out and "…" not in out
    for component in ("weights:", "gradients:", "optimizer:", "model_states:", "activations:", "overhead:",
                      "step_time:", "training_time:"):
        assert component in out
    # long sources are wrapped onto indented lines, never cut
    assert "deepspeed/runtime/zero/stage_1_and_2.py" in out and "arXiv:2205.05198" in out
