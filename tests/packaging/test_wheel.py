"""dm-toolkit as a user installs it: the wheel built from this checkout, installed into a fresh virtual environment
(the project's environment underneath for torch, DeepSpeed, ...), and every `dmt` verb run from a directory outside
the checkout, so a file a verb reads at run time and the wheel lacks (a template, a preset, the explorer's page)
fails here, not on a user's machine."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml

from helpers import ROOT, TINY, tiny_prediction, write_run
from toolkit.cli.main import VERBS

PACKAGE = ROOT / "toolkit"
# the verbs the tests below run from the installed wheel (a new verb joins them: the first test says so)
RUN_HERE = {"estimate", "plan", "generate", "validate", "slurm", "convert", "ckpt", "restore-test", "health", "report",
            "calibrate", "explore", "k8s", "data"}


def _data_files() -> set[Path]:
    """Every file of the package that is not Python source: what a verb may read at run time."""
    return {path for path in PACKAGE.rglob("*") if path.is_file() and path.suffix not in (".py", ".pyc")
            and "__pycache__" not in path.parts}


def test_every_data_file_of_the_package_is_package_data_and_every_verb_is_run_from_the_wheel():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["toolkit"]
    listed = {path for pattern in patterns for path in PACKAGE.glob(pattern) if path.is_file()}
    assert _data_files() - listed == set(), "add these to [tool.setuptools.package-data] in pyproject.toml"
    assert RUN_HERE == set(VERBS)


class Installed:
    """The wheel installed into its own virtual environment, and a user's directory outside the checkout."""

    def __init__(self, root: Path, wheel: Path):
        self.wheel, self.venv, self.home = wheel, root / "venv", root / "user"
        self.home.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        self.env = dict(env, PATH=f"{self.venv / 'bin'}:{env['PATH']}", PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1",
                        WANDB_MODE="offline")

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.venv / "bin" / argv[0]), *argv[1:]], cwd=self.home, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def dmt(self, *argv: str, code: int = 0, timeout: float = 120) -> str:
        """`dmt ARGV` from the user's directory; its stdout, once the exit code is `code`."""
        result = self.run("dmt", *argv, timeout=timeout)
        assert result.returncode == code, (argv, result.returncode, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        return result.stdout if code == 0 else result.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """Built once per module: `pip wheel` of a copy of the checkout's package (no stale build/ of the checkout can
    slip into it), installed with `pip install --no-deps` into a venv made with --system-site-packages; the project's
    environment (a venv itself, whose packages --system-site-packages does not reach) is added as a plain path, so
    its .pth files, the editable install of the checkout among them, are never run."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(PACKAGE, source / "toolkit", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (root / "dist").glob("dm_toolkit-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)
    subprocess.run([*pip, "--python", str(root / "venv" / "bin" / "python"), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = Installed(root, wheel)
    site = env.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    project = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (Path(site) / "dmt-test-project-env.pth").write_text("".join(f"{path}\n" for path in project))
    return env


@pytest.mark.launch
def test_the_installed_toolkit_is_the_wheels_own_with_every_data_file(installed):
    result = installed.run("python", "-c", "import sysconfig, toolkit; print(toolkit.__file__); "
                                           "print(sysconfig.get_paths()['purelib'])")
    toolkit_file, site = result.stdout.split()
    assert Path(toolkit_file) == Path(site) / "toolkit" / "__init__.py", result.stdout  # not the checkout's
    assert Path(site).is_relative_to(installed.venv)
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    assert {str(path.relative_to(ROOT)) for path in _data_files()} <= names
    listed = installed.dmt("--help")
    assert all(verb in listed for verb in VERBS)


@pytest.mark.launch
def test_estimate_plan_generate_validate_slurm_and_k8s_render_a_recipe(installed):
    """The tiny recipe as a user's file (its corpus named by absolute path) through the whole planning chain."""
    recipe = installed.home / "recipe.yaml"
    recipe.write_text(TINY.read_text().replace("data/tiny_corpus.txt", str(TINY.parent / "data/tiny_corpus.txt")))
    estimate = json.loads(installed.dmt("estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--json"))
    assert 8.0e9 < estimate["params"]["total"] < 8.1e9 and estimate["fits"]  # the preset and the GPU catalogue
    plans = json.loads(installed.dmt("plan", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "2048",
                                     "--global-batch", "16", "--top", "3", "--json"))
    assert 1 <= len(plans["plans"]) <= 3 and plans["considered"] > 0  # one object: plans, rejected, calibration
    installed.dmt("generate", "recipe.yaml", "--out", "gen")
    generated = installed.home / "gen"
    assert {"plan.json", "deepspeed.json", "accelerate.yaml", "trainer_args.json", "launch.sh",
            "slurm.sbatch"} <= {path.name for path in generated.iterdir()}
    assert "#SBATCH --job-name=tiny-llama-cpu" in (generated / "slurm.sbatch").read_text()
    assert "valid for world size 2" in installed.dmt("validate", "gen/deepspeed.json", "--world-size", "2",
                                                     "--trainer-args", "gen/trainer_args.json")
    sbatch = installed.dmt("slurm", "render", "recipe.yaml")
    assert sbatch.startswith("#!/usr/bin/env bash") and "torchrun" in sbatch
    # the Kubernetes manifest, checked against the CRDs the wheel ships (toolkit/generate/k8s/crds)
    assert "kubectl apply -f" in installed.dmt("k8s", "render", "recipe.yaml", "--kind", "jobset", "--image",
                                               "registry.example.com/dmt:1", "--out", "job.yaml")
    assert "valid (JobSet of kubernetes-sigs/jobset v0.12.0" in installed.dmt("validate", "job.yaml")


@pytest.mark.launch
def test_report_calibrate_and_a_calibrated_estimate_of_a_finished_run(installed):
    run = write_run(installed.home / "run", tiny_prediction())
    report = json.loads(installed.dmt("report", str(run), "--json"))
    assert report["runs"][0]["status"] == "completed" and report["runs"][0]["measured"]["step_time_s"] > 0
    installed.dmt("calibrate", "run", "--out", "calibration.yaml")
    assert yaml.safe_load((installed.home / "calibration.yaml").read_text())["hardware"] == "h100-80gb"
    estimate = json.loads(installed.dmt("estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--calibration",
                                        "calibration.yaml", "--json"))
    assert estimate["calibration"]["hardware"] == "h100-80gb"


@pytest.mark.launch
def test_data_prepare_and_inspect_answer_from_the_wheel(installed):
    """The golden corpus prepared from the user's directory: Megatron-LM's bytes, read back by inspect."""
    data = ROOT / "tests" / "data"
    prepared = json.loads(installed.dmt("data", "prepare", "--input", str(data / "golden" / "corpus.jsonl"),
                                        "--tokenizer", str(data / "tokenizer"), "--output-prefix", "corpus",
                                        "--workers", "1", "--json"))
    assert prepared["datasets"]["text"]["documents"] == 13
    for suffix in (".bin", ".idx"):
        assert (installed.home / f"corpus_text_document{suffix}").read_bytes() == \
            (data / "golden" / f"plain_text_document{suffix}").read_bytes()
    summary = json.loads(installed.dmt("data", "inspect", "corpus", "--json"))
    assert summary["datasets"]["text"]["first_document"]["text"].startswith("The ")


@pytest.mark.launch
def test_health_checks_one_local_rank(installed):
    report = json.loads(installed.dmt("health", "--nproc", "1", "--sizes", "4K", "--iters", "1", "--matmul-seconds",
                                      "0.05", "--json", timeout=300))
    assert report["ok"] and report["world_size"] == 1


@pytest.mark.launch
def test_checkpoint_verbs_and_restore_test_answer_from_the_wheel(installed):
    """ckpt inspect on a real (tiny) HF safetensors directory; convert and restore-test, whose real runs need a
    checkpoint or training launches, refuse cheap bad input in one line after loading their modules."""
    import numpy as np
    from safetensors.numpy import save_file

    hf = installed.home / "hf"
    hf.mkdir()
    save_file({"model.embed_tokens.weight": np.ones((8, 4), dtype=np.float32)}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    inspected = json.loads(installed.dmt("ckpt", "inspect", "hf", "--json"))
    assert inspected["format"] == "hf-safetensors" and inspected["parameters"] == 32
    assert "CKPT_DIR" in installed.dmt("convert", "zero-to-hf", "hf", "out", code=2)
    recipe = installed.home / "restore.yaml"
    recipe.write_text(TINY.read_text().replace("data/tiny_corpus.txt", str(TINY.parent / "data/tiny_corpus.txt")))
    refusal = installed.dmt("restore-test", "--recipe", "restore.yaml", "--backend", "megatron", "--steps", "2",
                            code=2)  # after the plan is resolved from the recipe, the presets and the catalogue
    assert "--steps" in refusal and "warmup_steps" in refusal
    assert not (installed.home / "out").exists()


@pytest.mark.launch
def test_explore_serves_its_page_and_renders_launch_files(installed):
    process = subprocess.Popen([str(installed.venv / "bin" / "dmt"), "explore", "--port", "0"], cwd=installed.home,
                               env=installed.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 120)
        line = process.stdout.readline() if ready else ""
        assert line.startswith("dmt explore: serving "), (line, process.poll())
        url = line.split()[3]
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        for asset in ("static/app.js", "static/style.css", "static/vendor/chart-4.6.1.umd.min.js"):
            assert f"/{asset}" in page and urllib.request.urlopen(url + asset, timeout=30).status == 200

        def post(path: str, body: dict):
            request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(request, timeout=120).read())

        ranked = post("api/plan", {"model": "llama-3.1-8b", "gpus": 8, "seq_len": 2048, "global_batch": 16,
                                   "top": 1})["plans"]
        files = post("api/generate", {"model": "llama-3.1-8b", "gpu": ranked[0]["gpu"], "plan": ranked[0]["plan"]})
        assert "#SBATCH" in files["files"]["slurm.sbatch"]
    finally:
        process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if process.poll() is None:
            process.kill()
        _, err = process.communicate()
    assert process.returncode == 130 and "Traceback" not in err, err
