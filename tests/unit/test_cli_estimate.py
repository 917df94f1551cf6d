"""`dmt estimate` as a user meets it: presets, JSON contract, and one clear line for every kind of bad input."""

import json
import subprocess
import sys

import pytest

from toolkit.cli.main import main
from toolkit.spec.model import preset_names

PRESETS = [
    "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "llama-3.2-1b", "llama-3.2-3b", "mistral-7b-v0.1",
    "mixtral-8x7b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b",
    "gemma-2-9b", "phi-3-mini", "gpt2", "gpt2-xl", "opt-1.3b", "pythia-1b", "deepseek-v3", "kimi-k2", "gpt-oss-20b",
    "gpt-oss-120b",
]
# Published sizes (model cards), in billions, to the precision the cards state them.
PUBLISHED_B = {
    "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "llama-3.1-405b": 405.85, "llama-3.2-1b": 1.24,
    "llama-3.2-3b": 3.21, "mistral-7b-v0.1": 7.24, "mixtral-8x7b": 46.70, "qwen2.5-0.5b": 0.49,
    "qwen2.5-7b": 7.62, "qwen2.5-72b": 72.71, "qwen3-8b": 8.19, "qwen3-30b-a3b": 30.53, "qwen3-235b-a22b": 235.0,
    "gemma-2-9b": 9.24,
    "phi-3-mini": 3.82, "gpt2": 0.124, "gpt2-xl": 1.56, "opt-1.3b": 1.32, "pythia-1b": 1.01,
    # DeepSeek-V3's card: 671B without its MTP module; GPT-OSS: OpenAI's model card (arXiv:2508.10925, Table 1)
    "deepseek-v3": 671.0, "kimi-k2": 1000.0, "gpt-oss-20b": 20.91, "gpt-oss-120b": 116.83,
}
ONE_FIGURE = ("kimi-k2",)  # Kimi K2's card: "1 trillion total parameters", one significant figure


def _estimate_json(capsys, *argv):
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_required_preset_ships():
    assert set(PRESETS) <= set(preset_names())


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_parameter_count_matches_the_model_card(capsys, preset):
    report = _estimate_json(capsys, "--model", preset, "--gpus", "8", "--seq-len", "1024")
    assert report["params"]["total"] / 1e9 == pytest.approx(PUBLISHED_B[preset], rel=0.05 if preset in ONE_FIGURE else 0.01)


def test_json_contract_for_llama_70b_on_64_gpus_zero3(capsys):
    report = _estimate_json(capsys, "--model", "llama-3.1-70b", "--gpus", "64", "--zero", "3")
    assert {"total", "embedding", "active"} <= set(report["params"])
    assert set(report["memory_bytes"]) == {"weights", "gradients", "optimizer", "activations", "overhead", "total"}
    mem = report["memory_bytes"]
    for key in ("dp", "tp", "pp", "vpp", "cp", "ep", "zero", "micro_batch", "grad_accum", "global_batch", "seq_len", "recompute"):
        assert key in report["plan"]
    assert report["plan"]["dp"] == 64 and report["plan"]["zero"] == 3
    assert report["gpu_memory_bytes"] > 70 * 1024**3
    assert report["fits"] is (mem["total"] <= report["gpu_memory_bytes"])
    # ZeRO-3 (arXiv:1910.02054 Sec. 5): 2 + 2 + 12 bytes per parameter, each spread over the 64 data-parallel ranks
    params = report["params"]["total"]
    assert mem["weights"] == pytest.approx(2 * params / 64, rel=0.01)
    assert mem["gradients"] == pytest.approx(2 * params / 64, rel=0.01)
    assert mem["optimizer"] == pytest.approx(12 * params / 64, rel=0.01)


def test_full_recompute_makes_llama_70b_fit_and_none_does_not(capsys):
    common = ["--model", "llama-3.1-70b", "--gpus", "64", "--zero", "3", "--seq-len", "4096"]
    assert not _estimate_json(capsys, *common)["fits"]
    assert _estimate_json(capsys, *common, "--recompute", "full")["fits"]


@pytest.mark.parametrize("gpus, fits", [(8, True), (1, False)])
def test_human_output_is_a_table_with_the_verdict_of_the_json(capsys, gpus, fits):
    """Llama 3.1 8B with ZeRO-1 fits 8 H100s, not one; the table says what --json says, with the same total."""
    argv = ["--model", "llama-3.1-8b", "--gpus", str(gpus)]
    report = _estimate_json(capsys, *argv)
    assert report["fits"] is fits
    assert main(["estimate", *argv]) == 0
    out = capsys.readouterr().out
    for word in ("weights", "gradients", "optimizer", "activations", "overhead", "total"):
        assert word in out
    assert ("does not fit in" in out) is not fits and ("fits in" in out) is fits
    total_row = next(line for line in out.splitlines() if "total" in line)
    assert f"{report['memory_bytes']['total'] / 1024**3:.2f}" in total_row


def test_model_from_hf_config_directory_and_toolkit_yaml(capsys, tiny_llama_dir, tmp_path):
    from_dir = _estimate_json(capsys, "--model", str(tiny_llama_dir), "--gpus", "2", "--seq-len", "128")
    spec = tmp_path / "tiny.yaml"
    spec.write_text(
        "num_layers: 4\nhidden_size: 256\nnum_attention_heads: 8\nnum_kv_heads: 4\nhead_dim: 32\n"
        "ffn_hidden_size: 688\nvocab_size: 1024\nactivation: swiglu\nnorm: rmsnorm\n"
    )
    from_yaml = _estimate_json(capsys, "--model", str(spec), "--gpus", "2", "--seq-len", "128")
    assert from_dir["params"] == from_yaml["params"]


BAD_INPUTS = [
    (["--model", "no-such-model", "--gpus", "8"], "--model"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--tp", "3"], "--tp"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--pp", "5"], "--pp"),
    (["--model", "llama-3.1-8b", "--gpus", "12", "--tp", "8"], "--gpus"),
    (["--model", "llama-3.1-8b", "--gpus", "0"], "--gpus"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--micro-batch", "-1"], "--micro-batch"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "12"], "--global-batch"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "tpu-v9"], "--gpu"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--pp", "2", "--zero", "2"], "--pp"),  # no DeepSpeed pipeline engine
    (["--model", "llama-3.1-8b", "--gpus", "8", "--tp", "2", "--zero", "2"], "--tp"),  # no AutoTP via the Trainer
    (["--model", "llama-3.1-8b", "--gpus", "8", "--zero", "3", "--offload-params", "nvme"], "--nvme-path"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--ep", "2"], "--ep"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--recompute", "sometimes"], "--recompute"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--recompute-modules", "mlp"], "--recompute-modules"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--backend", "megatron", "--recompute", "selective",
      "--recompute-modules", "attention"], "--recompute-modules"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--recompute", "full", "--recompute-num-layers", "2"],
     "--recompute-num-layers"),
    (["--model", "llama-3.1-8b", "--gpus", "8", "--backend", "megatron", "--recompute", "full",
      "--recompute-num-layers", "0"], "--recompute-num-layers"),
    # Llama 3 405B's 7/8/7 split cannot interleave: the first/last counts must divide by --vpp
    (["--model", "llama-3.1-405b", "--gpus", "2048", "--backend", "megatron", "--tp", "8", "--pp", "16",
      "--vpp", "2", "--first-stage-layers", "7", "--last-stage-layers", "7", "--global-batch", "512"],
     "--first-stage-layers"),
    (["--model", "llama-3.1-405b", "--gpus", "2048", "--backend", "megatron", "--tp", "8", "--pp", "16",
      "--vpp", "3", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
      "--global-batch", "512"], "--pp"),
]


@pytest.mark.parametrize("argv, flag", BAD_INPUTS, ids=[flag for _, flag in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line_naming_the_flag(capsys, argv, flag):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "Traceback" not in err


def test_malformed_config_file_names_the_file(capsys, tmp_path):
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "llama", "hidden_size": ')
    assert main(["estimate", "--model", str(broken), "--gpus", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(broken) in err


def test_unsupported_family_and_invalid_spec_key(capsys, tmp_path):
    t5 = tmp_path / "t5.json"
    t5.write_text('{"model_type": "t5"}')
    assert main(["estimate", "--model", str(t5), "--gpus", "1"]) == 2
    assert "model_type" in capsys.readouterr().err
    spec = tmp_path / "bad.yaml"
    spec.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nnum_kv_heads: 4\nhead_dim: 16\n"
                    "ffn_hidden_size: 128\nvocab_size: 100\nwarp_drive: true\n")
    assert main(["estimate", "--model", str(spec), "--gpus", "1"]) == 2
    assert "warp_drive" in capsys.readouterr().err


def test_real_entry_point_exit_code_and_no_traceback():
    result = subprocess.run([sys.executable, "-m", "toolkit", "estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--tp", "3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--tp" in result.stderr and "Traceback" not in result.stderr


def test_help_imports_no_heavy_library():
    """`dmt --help` must start instantly: building the parser may not import torch, transformers or deepspeed."""
    code = ("import sys; from toolkit.cli.main import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'megatron', 'rich') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


MALFORMED_HF_CONFIGS = [  # each once ended in a traceback from transformers or a family reader
    ({"model_type": "llama", "num_attention_heads": 0}, "num_attention_heads"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 7, "num_key_value_heads": 7}, "hidden size"),
    ({"model_type": "llama", "hidden_size": "big"}, "hidden_size"),
    ({"model_type": "llama", "vocab_size": None}, "vocab_size"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"model_type": 5}, "model_type"),
]


@pytest.mark.parametrize("config, named", MALFORMED_HF_CONFIGS, ids=[n for _, n in MALFORMED_HF_CONFIGS])
def test_malformed_hf_config_is_one_line_naming_the_key(capsys, tmp_path, config, named):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["estimate", "--model", str(path), "--gpus", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and "Traceback" not in err
    assert len(err) < 400  # an unknown model_type lists the supported families, not every transformers model


def test_yaml_syntax_error_is_one_line(capsys, tmp_path):
    spec = tmp_path / "broken.yaml"
    spec.write_text("num_layers: [1\n")
    assert main(["estimate", "--model", str(spec), "--gpus", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(spec) in err


@pytest.mark.parametrize("report", [{"bandwidth": []}, {"bandwidth": {"intra_node_busbw_gbps": "fast"}},
                                    {"bandwidth": {"inter_node_busbw_gbps": -3}}])
def test_measured_bandwidth_of_the_wrong_shape_names_the_flag(capsys, tmp_path, report):
    health = tmp_path / "health.json"
    health.write_text(json.dumps(report))
    assert main(["estimate", "--model", "gpt2", "--gpus", "16", "--measured-bw", str(health)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--measured-bw" in err


def test_hub_id_is_read_through_autoconfig_from_the_local_cache(tmp_path):
    """A hub id goes through AutoConfig.from_pretrained; offline, it resolves from the HF cache (no network)."""
    import os
    from pathlib import Path

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    preset = Path(__file__).resolve().parents[2] / "toolkit" / "presets" / "models" / "llama-3.2-1b.json"
    (snapshot / "config.json").write_text(preset.read_text())
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    run = lambda model: subprocess.run([sys.executable, "-m", "toolkit", "estimate", "--model", model, "--gpus", "1", "--json"],
                                       capture_output=True, text=True, timeout=120, env=env)
    cached = run("acme/tiny-llama")
    assert cached.returncode == 0, cached.stderr
    report = json.loads(cached.stdout)
    assert report["model"] == "acme/tiny-llama" and report["params"]["total"] == 1_235_814_400
    missing = run("acme/not-cached")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "--model" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr and "Traceback" not in missing.stderr


def test_an_option_is_never_matched_by_its_prefix(capsys, tmp_path):
    """`dmt generate` has no --gpu (the recipe names the GPU): argparse's prefix matching took `--gpu gb200` for
    --gpus-per-node and refused "expects an integer"; every parser of the toolkit matches whole option names."""
    from helpers import ROOT
    from toolkit.train import build_parser as train_parser

    recipe = ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml"
    capsys.readouterr()
    assert main(["generate", str(recipe), "--out", str(tmp_path / "out"), "--gpu", "gb200"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dmt: error: unrecognized arguments: --gpu gb200" and not (tmp_path / "out").exists()
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--micro", "2"]) == 2
    assert "unrecognized arguments: --micro 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_parser().parse_args(["--max-step", "3"])
