"""Fixtures of the Megatron-Core tests: the tiny Megatron recipe and its variants, and real torchrun launches (gloo,
CPU) shared by every test that asserts something about them (each launch runs once per session)."""

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from megatron_helpers import BIN, MOE_STEPS, SAVE_AT, STEPS, TINY_MEGATRON, TINY_MOE, TRAIN

from helpers import PROFILED, Launch, free_port


@pytest.fixture(scope="session")
def megatron_recipe(tmp_path_factory):
    """megatron_recipe(name, plan={...}, training={...}) -> a copy of the tiny Megatron recipe with sections updated
    and data paths made absolute."""
    directory = tmp_path_factory.mktemp("megatron-recipes")

    def make(name: str, **changes) -> Path:
        recipe = yaml.safe_load(TINY_MEGATRON.read_text())
        recipe["data"]["train_files"] = [str(TINY_MEGATRON.parent / f) for f in recipe["data"]["train_files"]]
        for section, values in changes.items():
            recipe.setdefault(section, {}).update(values)
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path

    return make


@pytest.fixture(scope="session")
def torchrun(tmp_path_factory):
    """torchrun(name, script, *args, nproc=2) -> Launch; `script` defaults to toolkit/train.py and gets
    `--output-dir <dir>` added. Each name runs once however many tests ask for it."""
    root = tmp_path_factory.mktemp("megatron-launches")
    done: dict[str, Launch] = {}

    def run(name: str, *args: str, script: Path | None = None, nproc: int = 2) -> Launch:
        if name in done:
            return done[name]
        out, log = root / name, root / f"{name}.log"
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
               *(TRAIN if script is None else (str(script),)),
               *args, "--output-dir", str(out)]
        env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        with open(log, "w") as handle:
            rc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=600).returncode
        done[name] = Launch(out, rc, log)
        return done[name]

    return run



@pytest.fixture(scope="session")
def distopt_recipe(megatron_recipe):
    return megatron_recipe("tiny-megatron-distopt", plan={"distributed_optimizer": True},
                           training={"report_to": ["wandb"], **ASYNC})


@pytest.fixture(scope="session")
def distopt_sync_recipe(megatron_recipe):
    return megatron_recipe("tiny-megatron-distopt-sync", plan={"distributed_optimizer": True},
                           training={"async_save": False})


@pytest.fixture(scope="session")
def dp2_resumed(torchrun, layout_run, distopt_sync_recipe):
    """The dp2 run resumed from its background save at SAVE_AT (dp_reshardable), saving synchronously every 2 steps
    (fully_reshardable, loadable at any layout: the move to TP=2 and the TP=1/TP=2 logits read RESAVE_AT and STEPS)."""
    return torchrun("dp2-resume", "--recipe", str(distopt_sync_recipe), "--max-steps", str(STEPS), "--save-steps", "2",
                    "--resume", str(layout_run("dp2").out / f"checkpoint-{SAVE_AT}"))


# The layout runs save in the background (asked for: on CPU ranks training.async_save is off unless a recipe says
# so, Backend.saves_async): each layout's checkpoints are async dist_checkpointing saves, with their records.
ASYNC = {"async_save": True}


@pytest.fixture(scope="session")
def layout_run(torchrun, distopt_recipe, megatron_recipe, tmp_path_factory):
    """layout_run("tp2" | "pp2" | "dp2") -> the Launch of that 2-rank layout, training STEPS steps with a checkpoint
    every SAVE_AT: TP=2 from the files `dmt generate --tp 2` wrote (train.py --plan, megatron.yaml as generated;
    steps PROFILED recorded by torch.profiler);
    PP=2 (1F1B) and DP=2 with the distributed optimizer from the recipe (a launch without --plan)."""
    from toolkit.cli.main import main

    def run(layout: str) -> Launch:
        if layout == "tp2":
            recipe = megatron_recipe("tiny-megatron-tp2", training={"max_steps": STEPS, "save_steps": SAVE_AT, **ASYNC})
            generated = tmp_path_factory.mktemp("megatron-tp2-generated")
            assert main(["generate", str(recipe), "--out", str(generated), "--tp", "2"]) == 0
            return torchrun(layout, "--plan", str(generated / "plan.json"), "--profile-steps", "-".join(PROFILED))
        recipe, *flags = {"pp2": (megatron_recipe("tiny-megatron-pp2", training=ASYNC), "--pp", "2"),
                          "dp2": (distopt_recipe,)}[layout]
        return torchrun(layout, "--recipe", str(recipe), *flags, "--max-steps", str(STEPS),
                        "--save-steps", str(SAVE_AT))

    return run


@pytest.fixture(scope="session")
def moe_run(torchrun, megatron_recipe, tmp_path_factory):
    """moe_run(family, *plan_flags) -> the Launch of the family's tiny MoE model (megatron_helpers.TINY_MOE) trained
    MOE_STEPS steps by Megatron-Core on 2 ranks from the files `dmt generate` wrote with the given plan flags (e.g.
    "--ep", "2"; train.py --plan, megatron.yaml as generated), saving at step 3 and at the end; each (family, flags)
    runs once per session."""
    from toolkit.cli.main import main

    def run(family: str, *flags: str) -> Launch:
        name = "-".join((family, *(flag.strip("-") for flag in flags)))
        recipe = megatron_recipe(f"tiny-{family}-megatron", model={"config": TINY_MOE[family]},
                                 training={"max_steps": MOE_STEPS, "save_steps": 3})
        generated = tmp_path_factory.mktemp(f"{name}-generated")
        assert main(["generate", str(recipe), "--out", str(generated), *flags]) == 0
        return torchrun(name, "--plan", str(generated / "plan.json"))

    return run
