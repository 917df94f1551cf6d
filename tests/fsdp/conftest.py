"""Fixtures of the FSDP2 tests: `dmt generate` of the tiny FSDP recipe, and real 2-rank CPU launches (gloo) shared by
every test that asserts something about them (each runs once per session): the dense tiny Llama, and a tiny Mixtral
whose experts FSDP2 shards as ordinary parameters."""

import subprocess
from pathlib import Path

import pytest
from fsdp_helpers import BIN, MOE_FAMILY, MOE_SAVE_AT, MOE_STEPS, STEPS, TINY_FSDP, TRAIN, environment, restore_test

from helpers import PROFILED, TINY, TINY_MOE, Launch, free_port


@pytest.fixture(scope="session")
def fsdp_generated(tmp_path_factory) -> Path:
    """The directory `dmt generate recipes/tiny-llama-fsdp-cpu.yaml` writes."""
    from toolkit.cli.main import main

    out = tmp_path_factory.mktemp("fsdp-generated") / "gen"
    assert main(["generate", str(TINY_FSDP), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def accelerate_run(fsdp_generated, tmp_path_factory) -> Launch:
    """`accelerate launch --config_file gen/accelerate.yaml toolkit/train.py --plan gen/plan.json`: the generated files
    as written, 2 CPU ranks, STEPS steps, a checkpoint every STEPS / 2, steps PROFILED recorded by torch.profiler."""
    root = tmp_path_factory.mktemp("fsdp-accelerate")
    out, log = root / "run", root / "train.log"
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(fsdp_generated / "accelerate.yaml"),
           "--main_process_port", str(free_port()), *TRAIN, "--plan", str(fsdp_generated / "plan.json"),
           "--output-dir", str(out), "--max-steps", str(STEPS), "--save-steps", str(STEPS // 2),
           "--profile-steps", "-".join(PROFILED)]
    with open(log, "w") as handle:
        rc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=environment(), timeout=600).returncode
    return Launch(out, rc, log)


@pytest.fixture(scope="session")
def torchrun_restore(tmp_path_factory) -> tuple[Path, dict]:
    """`dmt restore-test --recipe tiny-llama-cpu.yaml --backend fsdp`: its reference run is the torchrun launch of
    `toolkit/train.py --recipe R --backend fsdp` (the DeepSpeed tiny recipe switched to FSDP2 on the command line),
    with training.async_save: true (a copy of the recipe): the checkpoint the run is killed after was written in the
    background, `latest` naming it a step or more after its save."""
    import yaml

    root = tmp_path_factory.mktemp("fsdp-restore")
    recipe = yaml.safe_load(TINY.read_text())
    recipe["data"]["train_files"] = [str(TINY.parent / f) for f in recipe["data"]["train_files"]]
    recipe["training"]["async_save"] = True
    (root / "tiny-async.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    workdir = root / "work"
    return workdir, restore_test(workdir, "--recipe", str(root / "tiny-async.yaml"), "--backend", "fsdp", "--steps",
                                 str(STEPS), "--save-at", str(STEPS // 2))


@pytest.fixture(scope="session")
def moe_reshard(tmp_path_factory) -> tuple[Path, dict]:
    """`dmt restore-test --recipe R --steps 8 --save-at 4 --resume-world-size 1`, R the FSDP tiny recipe with the
    tiny Mixtral of helpers.TINY_MOE as its model: the reference run trains it on 2 ranks (workdir/reference, its
    checkpoints DCP shards of both ranks), the interrupted one resumes its step-4 checkpoint on one rank."""
    import yaml

    root = tmp_path_factory.mktemp("fsdp-moe")
    recipe = yaml.safe_load(TINY_FSDP.read_text())
    recipe["data"]["train_files"] = [str(TINY_FSDP.parent / f) for f in recipe["data"]["train_files"]]
    recipe.update(name=f"tiny-{MOE_FAMILY}-fsdp-cpu", model={"config": TINY_MOE[MOE_FAMILY]})
    (root / "tiny-moe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    workdir = root / "work"
    return workdir, restore_test(workdir, "--recipe", str(root / "tiny-moe.yaml"), "--steps", str(MOE_STEPS),
                                 "--save-at", str(MOE_SAVE_AT), "--resume-world-size", "1")
