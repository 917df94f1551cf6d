"""Shared fixtures: tiny models built from configs, offline environment, real DeepSpeed ZeRO runs on 2 CPU ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import MOE_SAVED, TINY_MOE, free_port, launch_scheduler, remove_segments_since, tiny_llama_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture
def tiny_llama_dir(tmp_path):
    """A directory holding a tiny Llama config.json, as `--model DIR` expects."""
    path = tmp_path / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_llama_config()))
    return path


TESTS = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent


def launch_ds_saves(saves: dict[Path, tuple[int, bool | dict]], steps: int = 2) -> None:
    """Run tests/distributed/ds_save_tiny.py under `deepspeed --num_gpus 2` once, saving into each directory of
    `saves` at its (ZeRO stage, model): the tiny Llama with its embeddings tied (True) or not (False), or the model of
    an HF config dict."""
    specs = []
    for out, (stage, model) in saves.items():
        if isinstance(model, dict):
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(model))
        specs.append(f"--save={stage}:{out}" + (":config" if isinstance(model, dict) else ":tied" if model else ""))
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(TESTS / "distributed" / "ds_save_tiny.py"), *specs, "--steps", str(steps)]
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    # judge by what was written as well as the exit code (gloo may abort at interpreter exit)
    if not all((out / "latest").is_file() for out in saves):
        raise AssertionError(f"deepspeed save failed (rc={result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


@pytest.fixture
def gloo_group_of_one(monkeypatch):
    """A default process group of this one process (gloo): what torch.distributed.checkpoint and Megatron-Core's
    dist_checkpointing need to run in-process, no launch."""
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def zero_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """ZeRO-1 (tied embeddings), ZeRO-2 and ZeRO-3 checkpoints of a tiny Llama, and ZeRO-3 ones of the tiny MoE
    families of helpers.TINY_MOE ("zero3-<family>": its fused experts partitioned like any parameter), each saved by
    2 ranks. Not qwen3_moe's: the ZeRO-3 launch of tests/training/test_train_launch.py trains and converts it."""
    root = tmp_path_factory.mktemp("zero")
    saves = {"zero1-tied": (1, True), "zero2": (2, False), "zero3": (3, False),
             **{f"zero3-{family}": (3, TINY_MOE[family]) for family in MOE_SAVED}}
    launch_ds_saves({root / name: spec for name, spec in saves.items()})  # one launch, one engine after another
    return {name: root / name for name in saves}


@pytest.fixture(scope="session", autouse=True)
def no_deepspeed_shm_left_by_the_session():
    """Launches shared by several tests start in module- or session-scoped fixtures, before the per-test fixture
    below takes its time: what they leave goes when the session ends."""
    import time

    start = time.time() - 1
    yield
    remove_segments_since(start)


@pytest.fixture(autouse=True)
def no_deepspeed_shm_left():
    """Launches this test SIGKILLed (or scripts that call DeepSpeed directly) leave DeepSpeed's CPU all-reduce segments
    in /dev/shm, which is RAM; remove those created during the test once it is over."""
    import time

    start = time.time() - 1
    yield
    remove_segments_since(start)


@pytest.fixture(scope="session", autouse=True)
def datasets_cache_in_tmp(tmp_path_factory):
    """`datasets` caches what it reads; keep that out of the home directory (launched processes inherit it)."""
    cache = tmp_path_factory.mktemp("hf-datasets-cache")
    previous = os.environ.get("HF_DATASETS_CACHE")
    os.environ["HF_DATASETS_CACHE"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("HF_DATASETS_CACHE", None)
    else:
        os.environ["HF_DATASETS_CACHE"] = previous


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_as_a_terminal_delivers_it():
    """A suite started in the background (`cmd &`, nohup, some CI runners) inherits SIGINT ignored, and so does every
    process it starts: the Ctrl-C tests then send a signal nobody receives. Python's own handler, as in a terminal."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test leaves os.environ as it found it: a verb run in-process that set a rank's variables (RANK,
    WORLD_SIZE, ...) made a later train.py launch of the same session think it was one rank of a multi-node job."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (the Makefile's LAUNCH_LANE): helpers.launch_scheduler, which keeps each group whole."""
    return launch_scheduler(config, log)
