"""Inputs that never end, block, or explode once parsed: a link to /dev/zero, a FIFO, a file over its format's size,
a YAML alias bomb, JSON nested 100000 deep, a --model that looks local but is not there. Each is refused in one line
naming the flag or file (exit 2, no traceback), within seconds and without growing memory: every verb runs in a forked
child under a time limit and an address-space limit, so a read that blocks or never ends fails the test instead of
hanging it or the machine."""

import json
import os
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from test_fuzz_verbs import RECIPE_TEXT

from helpers import bounded
from toolkit.cli.main import main
from toolkit.readers import MAX_DEPTH, SIZE_LIMITS, read_yaml

DEEP_JSON = "[" * 100_000 + "]" * 100_000


def _dmt(argv: list[str]) -> tuple[int, list[str], float]:
    """(exit code, stderr lines, seconds) of `dmt ARGV` in a forked child under the fuzz files' time and address-space
    limits (helpers.bounded); a child killed so fails the test."""
    code, _, err, seconds = bounded(lambda: main([str(part) for part in argv]))
    return code, err, seconds


def _refused(argv: list[str], *names: str) -> str:
    """Run dmt and check it refused in one line naming `names` (within the hang guard, or the child is killed); that
    line."""
    code, err, seconds = _dmt(argv)
    text = "\n".join(err)
    assert code == 2 and len(err) == 1 and "Traceback" not in text, (code, text)
    assert all(str(name) in text for name in names), (names, text)
    return text


@pytest.fixture
def user_dir(tmp_path):
    """A user's directory: a valid recipe and DeepSpeed JSON, and the hostile things beside them."""
    (tmp_path / "recipe.yaml").write_text(RECIPE_TEXT)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    return tmp_path


# where a file can be given: argv with {file} for it (and {dir} for the user's directory), what the line must name
READERS = {
    "generate RECIPE": (["generate", "{file}.yaml", "--out", "{dir}/gen"], "--recipe"),
    "slurm render RECIPE": (["slurm", "render", "{file}.yaml"], "--recipe"),
    "validate FILE (yaml)": (["validate", "{file}.yaml", "--world-size", "2"], "FILE"),
    "validate FILE (DeepSpeed JSON)": (["validate", "{file}.json", "--world-size", "2"], "FILE"),
    "validate --trainer-args": (["validate", "{dir}/ds.json", "--world-size", "2", "--trainer-args", "{file}.json"],
                                "--trainer-args"),
    "estimate --calibration": (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--calibration",
                                "{file}.yaml"], "--calibration"),
    "generate --calibration": (["generate", "{dir}/recipe.yaml", "--out", "{dir}/gen", "--calibration",
                                "{file}.yaml"], "--calibration"),
    "estimate --model": (["estimate", "--model", "{file}.json", "--gpus", "8"], "--model"),
    "validate --model": (["validate", "{dir}/ds.json", "--world-size", "2", "--model", "{file}.json"], "--model"),
}
ENDLESS = {
    "a link to /dev/zero": lambda path: path.symlink_to("/dev/zero"),
    "a FIFO": lambda path: os.mkfifo(path),
    "a link to a FIFO": lambda path: (os.mkfifo(f"{path}.pipe"), path.symlink_to(f"{path}.pipe")),
}


def _argv(template: list[str], file: Path, directory: Path) -> tuple[list[str], Path]:
    """The argv, and the path the test makes ({file} with the suffix the argument gives it)."""
    argv = [part.format(file=file, dir=directory) for part in template]
    return argv, Path(next(part for part in argv if part.startswith(str(file))))


@pytest.mark.parametrize("kind", sorted(ENDLESS))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_file_that_never_ends_or_blocks_is_refused_before_it_is_read(user_dir, reader, kind):
    argv, path = _argv(READERS[reader][0], user_dir / "input", user_dir)
    ENDLESS[kind](path)
    line = _refused(argv, READERS[reader][1], path.name)
    assert "character device" in line or "FIFO" in line
    assert not (user_dir / "gen").exists()


@pytest.mark.parametrize("reader", ["generate RECIPE", "validate FILE (DeepSpeed JSON)", "estimate --calibration"])
def test_a_file_over_its_formats_limit_is_refused_without_reading_it(user_dir, reader):
    argv, path = _argv(READERS[reader][0], user_dir / "input", user_dir)
    with open(path, "wb") as handle:  # sparse: 16 MiB and a byte, none of it on disk
        handle.truncate(SIZE_LIMITS["json"] + 1)
    _refused(argv, READERS[reader][1], path.name, "16 MiB")


def _alias_bomb(levels: int = 9) -> str:
    """The billion laughs under the recipe's model.config: ten `lol`s, each level ten aliases of the one before."""
    lines = ["    lol0: &lol0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"    lol{i}: &lol{i} [{', '.join([f'*lol{i - 1}'] * 10)}]" for i in range(1, levels)]
    return RECIPE_TEXT.replace("  config:\n", "  config:\n" + "\n".join(lines) + "\n", 1)


@pytest.mark.parametrize("verb", ["generate", "validate", "slurm render"])
def test_a_yaml_alias_bomb_in_a_recipe_is_refused_and_nothing_is_written(user_dir, verb):
    recipe = user_dir / "bomb.yaml"
    recipe.write_text(_alias_bomb())
    assert len(recipe.read_bytes()) < len(RECIPE_TEXT) + 1500  # a kilobyte and a half of aliases, 10^9 values
    argv = {"generate": ["generate", recipe, "--out", user_dir / "gen"], "validate": ["validate", recipe,
            "--world-size", "2"], "slurm render": ["slurm", "render", recipe, "--out", user_dir / "job.sbatch"]}[verb]
    _refused(argv, recipe.name, "alias bomb")
    assert not (user_dir / "gen").exists() and not (user_dir / "job.sbatch").exists()


def test_a_recipe_whose_alias_contains_itself_is_refused(user_dir):
    recipe = user_dir / "loop.yaml"
    recipe.write_text(RECIPE_TEXT.replace("  config:\n", "  config:\n    loop: &me [1, *me]\n", 1))
    _refused(["generate", recipe, "--out", user_dir / "gen"], recipe.name, "*me")


def test_aliases_that_stay_small_still_read(tmp_path):
    """Sharing a mapping by an alias, and merging it, as YAML users do, reads as before; so do 10^5 laughs."""
    shared = tmp_path / "shared.yaml"
    shared.write_text("defaults: &d {lr: 0.1, steps: [1, 2]}\nfirst: *d\nsecond: {<<: *d, lr: 0.2}\n")
    assert read_yaml(shared) == {"defaults": {"lr": 0.1, "steps": [1, 2]}, "first": {"lr": 0.1, "steps": [1, 2]},
                                 "second": {"lr": 0.2, "steps": [1, 2]}}
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(_alias_bomb(levels=5))
    assert len(json.dumps(read_yaml(laughs)["model"]["config"]["lol4"])) > 500_000


def _deep_run_dir(directory: Path, file: str) -> Path:
    run = directory / "run"
    run.mkdir()
    (run / file).write_text(DEEP_JSON + "\n")
    return run / file


DEEP = {
    "--model": lambda d: (["estimate", "--model", d / "deep.json", "--gpus", "8"], d / "deep.json"),
    "DeepSpeed JSON": lambda d: (["validate", d / "deep.json", "--world-size", "2"], d / "deep.json"),
    "--trainer-args": lambda d: (["validate", d / "ds.json", "--world-size", "2", "--trainer-args", d / "deep.json"],
                                 d / "deep.json"),
    "a YAML recipe": lambda d: (["generate", d / "deep.yaml", "--out", d / "gen"], d / "deep.yaml"),
}


@pytest.mark.parametrize("where", sorted(DEEP))
def test_nesting_100000_deep_is_one_line_not_a_recursion_error(user_dir, where):
    argv, path = DEEP[where](user_dir)
    if not path.exists():
        path.write_text(DEEP_JSON)  # YAML's flow style reads JSON's brackets alike
    _refused(argv, path.name, f"deeper than {MAX_DEPTH}")


@pytest.mark.parametrize("name", ["run_plan.json", "metrics.jsonl"])
def test_a_run_file_nested_100000_deep_is_a_damaged_run(user_dir, name):
    """A run directory's files are data from elsewhere (toolkit/report/records.py): nesting past MAX_DEPTH is the
    run's damage, reported as such with no figures, as any other content no train.py writes."""
    path = _deep_run_dir(user_dir, name)
    if not path.exists():
        path.write_text(DEEP_JSON)
    from toolkit.report.runs import read_run

    code, err, _ = _dmt(["report", user_dir / "run", "--json"])  # in a child, bounded: no recursion, no traceback
    assert code == 0 and not err, err

    report = read_run(user_dir / "run")
    assert report.status == "damaged" and f"deeper than {MAX_DEPTH}" in report.reason and name in report.reason
    assert set(report.measured.values()) == {None}


def test_a_deep_manifest_is_one_line(tmp_path):
    """The manifest of a checkpoint directory (as `dmt ckpt verify` reads it)."""
    from toolkit.checkpoint.manifest import MANIFEST, read_manifest
    from toolkit.errors import UserInputError

    (tmp_path / MANIFEST).write_text(DEEP_JSON)
    with pytest.raises(UserInputError, match=f"deeper than {MAX_DEPTH}"):
        read_manifest(tmp_path)


def test_a_metrics_file_over_a_gigabyte_is_refused_without_reading_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "wb") as handle:  # sparse
        handle.truncate(SIZE_LIMITS["jsonl"] + 1)
    _refused(["report", run], "RUN_DIR", "metrics.jsonl", "1 GiB")


@pytest.mark.parametrize("model", ["./nope/config.json", "nope/config.json", "nope/spec.yaml", "~/nope-dmt/x",
                                   "a/b/c", "pipe", "dir/pipe"])
def test_a_model_that_looks_local_never_goes_to_the_hub(tmp_path, monkeypatch, model):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # were the hub tried, it would answer or retry: neither may happen
    (tmp_path / "dir").mkdir()
    for fifo in ("pipe", "dir/pipe"):
        os.mkfifo(tmp_path / fifo)
    line = _refused(["estimate", "--model", model, "--gpus", "8"], "--model", model)
    assert "hub config" not in line


def test_the_explorer_answers_a_deep_or_endless_body_with_4xx_and_one_line():
    """Bodies too deep for the one JSON path (a pasted config.json inside one too) are 400; a body past the
    explorer's own limit is 413 (tests/unit/test_fuzz_explorer.py has the rest of its hostile bodies)."""
    from toolkit.explore.server import MAX_BODY_BYTES, create_app

    client = TestClient(create_app())
    answers = [client.post("/api/estimate", content=DEEP_JSON),
               client.post("/api/plan", content='{"model": ' + DEEP_JSON + ', "gpus": 8}'),
               client.post("/api/generate", content=DEEP_JSON),
               client.post("/api/estimate", json={"model": "{\"a\": " + DEEP_JSON + "}", "gpus": 8}),
               client.post("/api/estimate", content=b" " * (MAX_BODY_BYTES + 1))]
    assert [response.status_code for response in answers] == [400, 400, 400, 400, 413], [a.text for a in answers]
    for response in answers:
        assert "\n" not in response.json()["error"] and "Traceback" not in response.json()["error"]
    assert "deeper than" in answers[0].json()["error"]
    assert answers[3].json()["key"] == "model" and f"deeper than {MAX_DEPTH}" in answers[3].json()["error"]


def _twice(text: str, suffix: str) -> tuple[str, str]:
    """`text` with its first top-level key given twice (YAML: a second line before the first; JSON: a second member
    at the end), and that key: a file that would otherwise be read with one of the two values silently dropped."""
    if suffix == ".json":
        data = json.loads(text)
        key = next(iter(data))
        return f"{json.dumps(data)[:-1]}, {json.dumps(key)}: {json.dumps(data[key])}}}", key
    lines = text.splitlines(keepends=True)
    at, match = next((i, m) for i, line in enumerate(lines) if (m := re.match(r"([A-Za-z_][\w.-]*):", line)))
    return "".join([*lines[:at], f"{match.group(1)}: null\n", *lines[at:]]), match.group(1)


@pytest.fixture(scope="module")
def sound_files(tmp_path_factory) -> Path:
    """One sound file of every kind a verb reads: a recipe, the files `dmt generate` writes for DeepSpeed and for
    Megatron-Core, a JobSet manifest, a calibration and an HF config.json."""
    from test_calibration import _calibration_file
    from test_fuzz_files import MEGATRON_TEXT

    from helpers import tiny_llama_config

    root = tmp_path_factory.mktemp("sound")
    (root / "recipe.yaml").write_text(RECIPE_TEXT)
    (root / "megatron-recipe.yaml").write_text(MEGATRON_TEXT)
    assert main(["generate", str(root / "recipe.yaml"), "--out", str(root / "ds")]) == 0
    assert main(["generate", str(root / "megatron-recipe.yaml"), "--out", str(root / "mcore")]) == 0
    here = os.getcwd()
    os.chdir(root)  # the image holds the directory it is rendered from
    try:
        assert main(["k8s", "render", "recipe.yaml", "--kind", "jobset", "--image", "reg.io/dmt:1", "--out",
                     "jobset.yaml"]) == 0
    finally:
        os.chdir(here)
    _calibration_file(root / "calibration.yaml")
    (root / "config.json").write_text(json.dumps(tiny_llama_config()))
    return root


# a file with a key given twice, wherever a verb reads one: (the sound file it is made from, argv with {file} for it
# and {dir} for the user's directory, what the line must name besides the key and the file)
TWICE = {
    "generate RECIPE": ("recipe.yaml", ["generate", "{file}", "--out", "{dir}/gen"], "--recipe"),
    "slurm render RECIPE": ("recipe.yaml", ["slurm", "render", "{file}", "--out", "{dir}/job.sbatch"], "--recipe"),
    "k8s render RECIPE": ("recipe.yaml", ["k8s", "render", "{file}", "--kind", "jobset", "--image", "reg.io/dmt:1",
                                          "--out", "{dir}/job.yaml"], "--recipe"),
    "restore-test --recipe": ("recipe.yaml", ["restore-test", "--recipe", "{file}", "--workdir", "{dir}/restore"],
                              "--recipe"),
    "validate deepspeed.json": ("ds/deepspeed.json", ["validate", "{file}", "--world-size", "2"], "FILE"),
    "validate accelerate.yaml": ("ds/accelerate.yaml", ["validate", "{file}", "--world-size", "2"], "FILE"),
    "validate --trainer-args": ("ds/trainer_args.json", ["validate", "{sound}/ds/deepspeed.json", "--world-size", "2",
                                                         "--trainer-args", "{file}"], "--trainer-args"),
    "validate megatron.yaml": ("mcore/megatron.yaml", ["validate", "{file}", "--world-size", "2"], "FILE"),
    "validate a JobSet manifest": ("jobset.yaml", ["validate", "{file}"], "FILE"),
    "estimate --model": ("config.json", ["estimate", "--model", "{file}", "--gpus", "8"], ""),
    "estimate --calibration": ("calibration.yaml", ["estimate", "--model", "llama-3.1-8b", "--gpus", "8",
                                                    "--calibration", "{file}"], "--calibration"),
    "plan --calibration": ("calibration.yaml", ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "512",
                                                "--global-batch", "8", "--calibration", "{file}"], "--calibration"),
    "report --calibration": ("calibration.yaml", ["report", "{dir}", "--calibration", "{file}"], "--calibration"),
}


@pytest.mark.parametrize("reader", sorted(TWICE))
def test_a_key_given_twice_is_refused_naming_the_key_and_the_file(sound_files, tmp_path, reader):
    """Python's json and yaml keep the last of two equal keys without a word (`zero: 2` ... `zero: 3` trains ZeRO-3
    though the reader saw `zero: 2` first): every JSON and YAML file a verb reads refuses it, in one line naming the
    key and the file, and nothing is written."""
    sound, template, flag = TWICE[reader]
    path = tmp_path / f"twice{Path(sound).suffix}"
    text, key = _twice((sound_files / sound).read_text(), path.suffix)
    path.write_text(text)
    before = sorted(tmp_path.rglob("*"))
    argv = [part.format(file=path, dir=tmp_path, sound=sound_files) for part in template]
    _refused(argv, flag, path.name, f"'{key}' twice")
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("text, value", [("a: &a {x: 1}\nb: {<<: *a, x: 2}\n", {"x": 2}),
                                         ("a: &a {x: 1}\nb: &b {<<: *a, x: 2}\nc: {<<: *b, y: 3}\n",
                                          {"x": 2, "y": 3})])
def test_a_key_a_merge_brought_in_may_still_be_overridden(tmp_path, text, value):
    """YAML's merge (`<<: *base`) then a key of its own is an override, as YAML means it, not a key given twice."""
    path = tmp_path / "merged.yaml"
    path.write_text(text)
    assert list(read_yaml(path).values())[-1] == value
