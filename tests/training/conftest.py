"""Fixtures of the training tests: generated files of the tiny recipe, recipe variants, and real launches shared by
several tests (one launch serves every assertion about it)."""

from pathlib import Path

import pytest
import yaml

from helpers import BIN, TINY, TRAIN, Launch, free_port, run_logged
from toolkit.runtime.ds_shm import segments


def recipe_variant(directory: Path, name: str, replace: dict | None = None, base: Path = TINY, **changes) -> Path:
    """A copy of the tiny recipe (or of `base`) with keys of some sections changed (`training={"report_to":
    ["wandb"]}`) or whole sections replaced (`replace={"model": {...}}`), data paths made absolute so the copy works
    from anywhere."""
    recipe = yaml.safe_load(base.read_text())
    recipe["data"]["train_files"] = [str(base.parent / f) for f in recipe["data"]["train_files"]]
    for section, values in changes.items():
        recipe.setdefault(section, {}).update(values)
    recipe.update(replace or {})
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def variant(tmp_path_factory):
    directory = tmp_path_factory.mktemp("recipes")
    return lambda name, replace=None, base=TINY, **changes: recipe_variant(directory, name, replace, base, **changes)


@pytest.fixture(scope="session")
def launch(tmp_path_factory):
    """launch(name, launcher, recipe, *train_flags, config_dir=None, env=None) -> Launch; each name runs once,
    however many tests ask for it."""
    root = tmp_path_factory.mktemp("launches")
    done: dict[str, Launch] = {}

    def run(name: str, launcher: str, recipe: Path, *flags: str, config_dir: Path | None = None,
            env: dict | None = None) -> Launch:
        if name in done:
            return done[name]
        out, log = root / name / "run", root / name / "train.log"
        port = str(free_port())
        train = [*TRAIN, "--recipe", str(recipe), "--output-dir", str(out), *flags]
        if launcher == "deepspeed":
            cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", port, *train]
        elif launcher == "accelerate":  # the generated files: accelerate.yaml, and plan.json with the rest
            cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(config_dir / "accelerate.yaml"),
                   "--main_process_port", port, *train, "--plan", str(config_dir / "plan.json")]
        elif launcher == "launch.sh":  # the generated script; its first flag names the launcher
            cmd = ["bash", str(config_dir / "launch.sh"), *flags]
            env = {**(env or {}), "MASTER_PORT": port, "OUTPUT_DIR": str(out), "RECIPE": str(recipe)}
        else:
            raise ValueError(launcher)
        # bounds a launch that ends by itself when things go well (a few tiny steps, or a 10 s hang timeout): one
        # DeepSpeed launch took ~70 s under load ~10 on 2 cores, and its start alone has taken minutes under
        # heavier load, so 1800 s (as launch_watched) costs nothing and leaves ~25x at load ~10
        rc = run_logged(cmd, log, 1800, env)
        done[name] = Launch(out, rc, log, shm_left=segments(port))
        return done[name]

    return run


@pytest.fixture(scope="session")
def generated(tmp_path_factory):
    """generated(recipe, *dmt_generate_flags) -> the output directory of `dmt generate` (once per arguments)."""
    from toolkit.cli.main import main

    root = tmp_path_factory.mktemp("generated")
    done: dict[tuple, Path] = {}

    def run(recipe: Path, *flags: str) -> Path:
        key = (str(recipe), *flags)
        if key not in done:
            out = root / f"gen{len(done)}"
            assert main(["generate", str(recipe), "--out", str(out), *flags]) == 0
            done[key] = out
        return done[key]

    return run
