"""fp8 under HF Trainer: Accelerate's FP8 (Transformer Engine or torchao) in the fsdp backend's accelerate.yaml, read
back through `accelerate launch`'s own argument handling into the ACCELERATE_FP8_* variables its recipe dataclasses
read; what Accelerate cannot train refused in one line; `dmt validate` checks fp8_config against those dataclasses;
train.py refuses an fp8 plan on CPU ranks before writing anything."""

import os
import subprocess
import sys

import pytest
import yaml

from helpers import ROOT
from toolkit.cli.main import main

SFT_8B = ROOT / "recipes" / "llama-3.1-8b-sft-8xh100.yaml"


def _generate(tmp_path, fp8_recipe: str, gpu: str = "h100-80gb", backend: str = "fsdp"):
    recipe = yaml.safe_load(SFT_8B.read_text())
    recipe["cluster"]["gpu"] = gpu
    recipe["base_dir"] = str(SFT_8B.parent)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "gen"
    code = main(["generate", str(path), "--out", str(out), "--backend", backend, "--precision", "fp8",
                 "--fp8-recipe", fp8_recipe])
    return code, out


def _launch_environment(config_file) -> dict[str, str]:
    """What `accelerate launch --config_file` puts in the training processes' environment for FP8 (its own parser,
    config merge and setup_fp8_env)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import setup_fp8_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.mixed_precision == "fp8"
    return setup_fp8_env(args, {})


# the variables Accelerator.fp8_backend and TERecipeKwargs.__post_init__ read (accelerate 1.15)
@pytest.mark.parametrize("recipe, gpu, expected", [
    ("delayed", "h100-80gb", {"FP8_BACKEND": "TE", "FP8_FORMAT": "HYBRID"}),
    ("mxfp8", "b200", {"FP8_BACKEND": "TE", "FP8_USE_MXFP8_BLOCK_SCALING": "True"}),
    ("tensorwise", "h100-80gb", {"FP8_BACKEND": "AO"}),
])
def test_fsdp_fp8_reaches_accelerates_recipe(tmp_path, capsys, recipe, gpu, expected):
    code, out = _generate(tmp_path, recipe, gpu)
    assert code == 0, capsys.readouterr().err
    config = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert config["mixed_precision"] == "fp8"
    trainer = yaml.safe_load((out / "trainer_args.json").read_text())
    assert not trainer.get("bf16") and not trainer.get("fp16")  # else the Trainer overrides Accelerate's fp8
    environment = _launch_environment(out / "accelerate.yaml")
    for key, value in expected.items():
        assert environment[f"ACCELERATE_{key}"] == value, environment
    capsys.readouterr()
    assert main(["validate", str(out / "accelerate.yaml"), "--world-size", "8", "--trainer-args",
                 str(out / "trainer_args.json")]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("backend, recipe, says", [
    ("fsdp", "blockwise", "--fp8-recipe: Accelerate's FP8 has no blockwise recipe"),
    ("deepspeed", None, "--precision: fp8 with DeepSpeed needs mixed_precision in accelerate.yaml, which Accelerate "
                        "refuses beside a deepspeed_config_file"),
])
def test_what_accelerate_cannot_train_is_one_line(capsys, backend, recipe, says):
    capsys.readouterr()
    flags = ["--fp8-recipe", recipe] if recipe else []
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--backend", backend, "--precision", "fp8",
                 *flags]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], lines


def test_fp4_is_megatrons_only(capsys):
    capsys.readouterr()
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--backend", "fsdp", "--precision", "fp4",
                 "--gpu", "b200"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--precision: Accelerate has no fp4 recipe" in lines[0], lines


@pytest.mark.parametrize("edit, says", [
    ({"fp8_format": "E4M4"}, "fp8_config.fp8_format: is 'E4M4'; Accelerate takes HYBRID, E4M3, E5M2"),
    # Accelerate's own questionnaire writes this key; TERecipeKwargs reads amax_history_len, so it would be dropped
    ({"amax_history_length": 16}, "fp8_config.amax_history_length: is not a key Accelerate reads here; did you "
                                  "mean 'amax_history_len'?"),
    ({"backend": "MSAMP"}, "fp8_config.backend: is 'MSAMP'; the toolkit's recipes run TE"),
    (None, "fp8_config: is missing: mixed_precision fp8 needs its backend"),
])
def test_validate_checks_fp8_config_with_accelerates_dataclasses(tmp_path, capsys, edit, says):
    code, out = _generate(tmp_path, "delayed")
    assert code == 0
    config = yaml.safe_load((out / "accelerate.yaml").read_text())
    if edit is None:
        del config["fp8_config"]
    else:
        config["fp8_config"].update(edit)
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(["validate", str(broken), "--world-size", "8"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and says in lines[0], lines


def test_train_py_refuses_an_fp8_plan_on_cpu_ranks_before_writing(tmp_path):
    code, out = _generate(tmp_path, "delayed")
    assert code == 0
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "toolkit.train", "--plan", str(out / "plan.json"),
                             "--output-dir", str(run)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "WORLD_SIZE": "8", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "train.py: error: --precision: fp8 runs CUDA kernels (Transformer Engine's, torchao's); CPU ranks train in "
        "bf16, fp16 or fp32"], result.stderr[-2000:]
    assert not run.exists()
