"""Every verb against bad input, as a table: malformed files, wrong types, hostile values, colliding and unwritable
outputs. For each case: exit code 2, no traceback, at most two lines on stderr naming the flag, key or file at fault,
every user file unchanged (checksums before and after) and nothing left behind. Hostile input of each trust-boundary
class has its own file beside this one: test_fuzz_pickles (checkpoints that would run code), test_fuzz_files (what
generate may delete, outputs over inputs), test_fuzz_reads (endless and unbounded reads, alias bombs, nesting),
test_fuzz_numbers (NaN and infinity everywhere), test_fuzz_records (damaged run records, a calibration's hardware),
test_fuzz_explorer (requests to `dmt explore`), test_fuzz_interrupts (Ctrl-C, one-line errors, unchecked inputs)."""

import hashlib
import json
import random
import tempfile
from pathlib import Path

import pytest

from helpers import FUZZ_HANG_GUARD_S, TINY, bounded
from toolkit.cli.main import main

DATA_TOKENIZER = str(TINY.parents[1] / "tests" / "data" / "tokenizer")
DATA_CORPUS = str(TINY.parents[1] / "tests" / "data" / "golden" / "corpus.jsonl")
RECIPE_TEXT = TINY.read_text().replace("data/tiny_corpus.txt", str(TINY.parent / "data/tiny_corpus.txt"))

# how a file the user names can be wrong
MALFORMED = {
    "binary": lambda p: p.write_bytes(random.Random(0).randbytes(512)),
    "utf16": lambda p: p.write_bytes('{"model_type": "llama"}'.encode("utf-16")),
    "empty": lambda p: p.write_text(""),
    "a-list": lambda p: p.write_text("[1, 2, 3]\n"),
    "truncated": lambda p: p.write_text('{"model_type": "llama", "hidden_size": '),
    "bad-yaml": lambda p: p.write_text("key: [unclosed\n  - x: {"),
    "a-number": lambda p: p.write_text("42\n"),
    "directory": lambda p: p.mkdir(),
    "missing": lambda p: None,
}

# verbs that read a user's file: argv with {file} for it, and what the error must name besides the path
FILE_INPUTS = {
    "estimate --model": (["estimate", "--model", "{file}", "--gpus", "8"], None),
    "estimate --measured-bw": (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--measured-bw", "{file}"],
                               "--measured-bw"),
    "plan --model": (["plan", "--model", "{file}", "--gpus", "8", "--seq-len", "512", "--global-batch", "8"], None),
    "generate RECIPE": (["generate", "{file}", "--out", "{tmp}/gen"], "--recipe"),
    "validate deepspeed.json": (["validate", "{file}.json", "--world-size", "2"], "FILE"),
    "validate megatron.yaml": (["validate", "{file}.yaml", "--world-size", "2"], "FILE"),
    "validate --trainer-args": (["validate", "{valid_ds}", "--world-size", "2", "--trainer-args", "{file}"],
                                "--trainer-args"),
    "slurm render RECIPE": (["slurm", "render", "{file}"], "--recipe"),
    "k8s render RECIPE": (["k8s", "render", "{file}", "--kind", "jobset", "--image", "reg.io/dmt:1"], "--recipe"),
    "validate k8s manifest.yaml": (["validate", "{file}.yaml"], "FILE"),
    "restore-test --recipe": (["restore-test", "--recipe", "{file}", "--workdir", "{tmp}/restore"], "--recipe"),
    "convert hf-to-megatron HF_DIR": (["convert", "hf-to-megatron", "{file}", "{tmp}/mcore"], "HF_DIR"),
    "convert zero-to-hf CKPT_DIR": (["convert", "zero-to-hf", "{file}", "{tmp}/hf"], "CKPT_DIR"),
    "convert fsdp-to-hf CKPT": (["convert", "fsdp-to-hf", "{file}", "{tmp}/hf"], None),
    "convert megatron-to-hf MEGATRON_DIR": (["convert", "megatron-to-hf", "{file}", "{tmp}/hf"], "MEGATRON_DIR"),
    "convert merge-lora BASE ADAPTER": (["convert", "merge-lora", "{file}", "{file}", "{tmp}/merged"], "BASE"),
    "ckpt inspect PATH": (["ckpt", "inspect", "{file}"], "PATH"),
    "validate accelerate.yaml": (["validate", "{file}.yaml", "--world-size", "2"], "FILE"),
    "estimate --calibration": (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--calibration", "{file}"],
                               "--calibration"),
    "plan --calibration": (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "512", "--global-batch",
                            "8", "--calibration", "{file}"], "--calibration"),
    "generate --calibration": (["generate", "{tmp}/recipe.yaml", "--out", "{tmp}/gen", "--calibration", "{file}"],
                               "--calibration"),
    "report RUN_DIR": (["report", "{file}"], "RUN_DIR"),
    "report --calibration": (["report", "{tmp}", "--calibration", "{file}"], "--calibration"),
    "calibrate RUN_DIR": (["calibrate", "{file}", "--out", "{tmp}/calibration.yaml"], "RUN_DIR"),
    "calibrate --health": (["calibrate", "{tmp}", "--health", "{file}", "--out", "{tmp}/calibration.yaml"],
                           "--health"),
    "data prepare --input": (["data", "prepare", "--input", "{file}.jsonl", "--tokenizer", DATA_TOKENIZER,
                              "--output-prefix", "{tmp}/prepared"], "--input"),
    "data prepare --tokenizer": (["data", "prepare", "--input", DATA_CORPUS, "--tokenizer", "{file}",
                                  "--output-prefix", "{tmp}/prepared"], "--tokenizer"),
    "data inspect PREFIX": (["data", "inspect", "{file}"], "PREFIX"),
}


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under root with the checksum of each file (directories as such)."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        found[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return found


def _run(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()]


def _assert_refused(code: int, err: list[str], *names: str) -> None:
    text = "\n".join(err)
    assert code == 2, (code, text)
    assert "Traceback" not in text and 1 <= len(err) <= 2, text
    assert all(name in text for name in names if name), (names, text)


@pytest.fixture
def sandbox(tmp_path):
    """A user's directory: a recipe, a valid DeepSpeed JSON; the test's own files go beside them."""
    (tmp_path / "recipe.yaml").write_text(RECIPE_TEXT)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization":
                                                  {"stage": 2}}))
    return tmp_path


@pytest.mark.parametrize("kind", sorted(MALFORMED))
@pytest.mark.parametrize("verb", sorted(FILE_INPUTS))
def test_a_malformed_input_file_is_one_line_naming_it(sandbox, capsys, verb, kind):
    argv_template, flag = FILE_INPUTS[verb]
    bad = sandbox / f"input-{kind}"
    suffix = next((part[len("{file}"):] for part in argv_template if part.startswith("{file}")), "")
    MALFORMED[kind](Path(f"{bad}{suffix}"))
    before = _snapshot(sandbox)
    argv = [part.format(file=bad, tmp=sandbox, valid_ds=sandbox / "ds.json") for part in argv_template]
    code, err = _run(capsys, argv)
    if kind == "missing" and verb.endswith("--model"):
        flag = "--model"  # a name that is no file is tried as a preset or hub id: the flag says what it takes
    _assert_refused(code, err, flag, "" if flag == "--model" else bad.name)
    assert _snapshot(sandbox) == before


# outputs: argv with {out}, the flag, and whether the target is a file or a directory
OUTPUTS = {
    "generate --out": (["generate", "{recipe}", "--out", "{out}"], "--out", "dir"),
    "plan --plot": (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "512", "--global-batch", "8",
                     "--plot", "{out}"], "--plot", "file"),
    "slurm render --out": (["slurm", "render", "{recipe}", "--out", "{out}"], "--out", "file"),
    "k8s render --out": (["k8s", "render", "{recipe}", "--kind", "trainjob", "--image", "reg.io/dmt:1", "--out",
                          "{out}"], "--out", "file"),
    "restore-test --workdir": (["restore-test", "--recipe", "{recipe}", "--workdir", "{out}"], "--workdir", "dir"),
    "health --output": (["health", "--nproc", "1", "--output", "{out}"], "--output", "file"),
    "report --plot": (["report", "{run}", "--plot", "{out}"], "--plot", "file"),
    "calibrate --out": (["calibrate", "{run}", "--out", "{out}"], "--out", "file"),
    "data prepare --output-prefix": (["data", "prepare", "--input", DATA_CORPUS, "--tokenizer", DATA_TOKENIZER,
                                      "--output-prefix", "{out}"], "--output-prefix", "file"),
}


def _bad_target(sandbox: Path, kind: str, target: str, suffix: str) -> str:
    if kind == "a-file-for-a-directory":
        path = sandbox / "taken"
        path.write_text("the user's\n")
        return str(path)
    if kind == "a-directory-for-a-file":
        path = sandbox / f"taken{suffix}"
        path.mkdir()
        return str(path)
    if kind == "under-a-file":
        (sandbox / "plain").write_text("the user's\n")
        return str(sandbox / "plain" / f"out{suffix}")
    if kind == "unwritable":
        return f"/proc/dmt-fuzz/out{suffix}"
    if kind == "empty":
        return ""
    if kind == "the-input-itself":
        return str(sandbox / "recipe.yaml")
    if kind in ("a-symlink", "a-dangling-symlink"):  # writing it would write where the link points, elsewhere
        (sandbox / "elsewhere").mkdir()
        victim = sandbox / "elsewhere" / f"victim{suffix}"
        if kind == "a-symlink":
            victim.write_text("the user's, kept elsewhere\n")
        (sandbox / f"link{suffix}").symlink_to(victim)
        return str(sandbox / f"link{suffix}")
    raise ValueError(kind)


OUTPUT_KINDS = ("a-file-for-a-directory", "a-directory-for-a-file", "under-a-file", "unwritable", "empty",
                "the-input-itself", "a-symlink", "a-dangling-symlink")


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
@pytest.mark.parametrize("verb", sorted(OUTPUTS))
def test_a_bad_output_is_refused_before_anything_is_written(sandbox, capsys, verb, kind):
    argv_template, flag, target = OUTPUTS[verb]
    if (kind == "a-file-for-a-directory" and target == "file") or \
            (kind == "a-directory-for-a-file" and target == "dir"):
        pytest.skip("a valid target of this kind")
    if kind == "a-symlink" and target == "dir":
        pytest.skip("a link to a directory is that directory; one to a file is a-file-for-a-directory")
    if kind == "the-input-itself" and verb in ("health --output", "report --plot"):
        pytest.skip("reads no file a .png could be: dmt health none, dmt report directories (a directory is refused "
                    "as a plot in the a-directory-for-a-file case)")
    suffix = ".png" if verb in ("plan --plot", "report --plot") else ""
    out = _bad_target(sandbox, kind, target, suffix)
    run = sandbox / "run"  # a run directory (its contents do not matter: outputs are checked first)
    run.mkdir()
    if kind == "the-input-itself" and verb == "plan --plot":
        out = str(sandbox / "ds.png")
        (sandbox / "ds.png").write_bytes(b"a user's picture")
        argv_template = [*argv_template[:-2], "--model", out, "--plot", out]
    elif kind == "the-input-itself" and verb == "calibrate --out":  # a file of a run it reads
        out = str(run / "metrics.jsonl")
        (run / "metrics.jsonl").write_text("{}\n")
    elif kind == "the-input-itself" and verb == "data prepare --output-prefix":  # its sidecar would replace its input
        out = str(sandbox / "corpus")
        (sandbox / "corpus.dmt.json").write_text('{"text": "a user\'s corpus"}\n')
        argv_template = [*argv_template[:3], out + ".dmt.json", *argv_template[4:]]
    elif kind.endswith("symlink") and verb == "data prepare --output-prefix":  # a link where it writes its sidecar
        (sandbox / "link.dmt.json").symlink_to(Path(out).resolve(strict=False))
        Path(out).unlink()
    before = _snapshot(sandbox)
    argv = [part.format(out=out, recipe=sandbox / "recipe.yaml", run=run) for part in argv_template]
    code, err = _run(capsys, argv)
    _assert_refused(code, err, flag if kind != "the-input-itself" or not suffix else "")
    assert _snapshot(sandbox) == before
    assert not Path("/proc/dmt-fuzz").exists()
    if kind.endswith("symlink"):
        assert "symbolic link" in err[-1], err


def test_validate_given_a_recipe_says_what_to_validate_in_one_line(sandbox, capsys):
    """A recipe read as a megatron.yaml was a page of 'section missing' lines: it is one line saying what validate
    checks and how to get those files from the recipe."""
    for extra in (["--world-size", "2"], []):
        code, err = _run(capsys, ["validate", str(sandbox / "recipe.yaml"), *extra])
        _assert_refused(code, err, "FILE", "recipe.yaml is a recipe", "dmt generate")
        assert len(err) == 1


def test_validate_takes_the_accelerate_yaml_generate_writes_for_deepspeed(sandbox, capsys):
    """The accelerate.yaml `dmt generate` writes for the deepspeed backend was refused by `dmt validate` as 'not
    FSDP': it is checked as what it is (Accelerate's keys, the process count)."""
    assert main(["generate", str(sandbox / "recipe.yaml"), "--out", str(sandbox / "gen")]) == 0
    capsys.readouterr()
    code, err = _run(capsys, ["validate", str(sandbox / "gen" / "accelerate.yaml"), "--world-size", "2"])
    assert code == 0 and not err, err
    code, err = _run(capsys, ["validate", str(sandbox / "gen" / "accelerate.yaml"), "--world-size", "3"])
    assert code == 2 and len(err) == 1 and "num_processes" in err[0], err


@pytest.mark.parametrize("flags", [["--resume-world-size", "3"], ["--resume-ep", "3"]])
def test_restore_test_refuses_a_resume_it_cannot_run_before_anything_runs(sandbox, capsys, monkeypatch,
                                                                          tmp_path_factory, flags):
    """The resumed run's plan is resolved with the others, before the reference run: 3 processes cannot train a
    global batch of 16 in micro-batches of 4 (it was found after two runs, in a worker's log), and the refusal leaves
    no scratch directory (one was made before the --resume-ep check)."""
    scratch = tmp_path_factory.mktemp("tmp")
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, err = _run(capsys, ["restore-test", "--recipe", str(sandbox / "recipe.yaml"), *flags])
    _assert_refused(code, err, flags[0])
    assert not list(scratch.glob("dmt-restore-*"))


def test_generate_never_replaces_what_it_did_not_write_and_cleans_its_own(sandbox, capsys):
    """A deepspeed.json of the user's stops `dmt generate` (--force replaces it); switching the recipe to Megatron
    removes the files generate wrote for DeepSpeed and keeps the user's own files and run directory."""
    out = sandbox / "gen"
    out.mkdir()
    (out / "deepspeed.json").write_text('{"mine": true}\n')
    (out / "notes.txt").write_text("the user's\n")
    before = _snapshot(sandbox)
    code, err = _run(capsys, ["generate", str(sandbox / "recipe.yaml"), "--out", str(out)])
    _assert_refused(code, err, "--out", "deepspeed.json", "--force")
    assert _snapshot(sandbox) == before
    assert main(["generate", str(sandbox / "recipe.yaml"), "--out", str(out), "--force"]) == 0
    assert json.loads((out / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 2
    (out / "run").mkdir()
    megatron = sandbox / "megatron.yaml"
    megatron.write_text(RECIPE_TEXT.replace("backend: deepspeed\n  zero: 2", "backend: megatron"))
    assert main(["generate", str(megatron), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"megatron.yaml", "plan.json", "launch.sh", "notes.txt", "run"} <= names
    assert not names & {"deepspeed.json", "accelerate.yaml", "trainer_args.json"}
    assert not [p for p in sandbox.iterdir() if ".tmp-" in p.name]
    capsys.readouterr()


def test_generate_never_overwrites_the_recipe_it_reads(sandbox, capsys):
    """A recipe saved as DIR/megatron.yaml, generated into DIR: refused, the recipe intact."""
    directory = sandbox / "job"
    directory.mkdir()
    recipe = directory / "megatron.yaml"
    recipe.write_text(RECIPE_TEXT.replace("backend: deepspeed\n  zero: 2", "backend: megatron"))
    before = _snapshot(sandbox)
    code, err = _run(capsys, ["generate", str(recipe), "--out", str(directory)])
    _assert_refused(code, err, "--out", "megatron.yaml")
    assert _snapshot(sandbox) == before


RECIPE_VALUES = {  # a recipe line replaced -> the key the error must name
    "micro_batch: true": ("micro_batch: 4", "micro_batch: true", "plan.micro_batch"),
    "max_steps as text": ("max_steps: 30", "max_steps: '30'", "training.max_steps"),
    "zero 5": ("zero: 2", "zero: 5", "plan.zero"),
    "unknown gpu": ("gpu: cpu", "gpu: h100-81gb", "cluster.gpu"),
    "hostile name": ("name: tiny-llama-cpu", "name: 'x; touch PWNED'", "name"),
    "name escaping": ("name: tiny-llama-cpu", "name: ../../escape", "name"),
    "negative seq": ("seq_len: 64", "seq_len: -64", "training.seq_len"),
    "tp not dividing heads": ("zero: 2", "zero: 2\n  tp: 3", "plan.tp"),
    "unknown plan key": ("zero: 2", "zero: 2\n  zerro: 1", "plan.zerro"),
    # the misspelt section is named, not the 'Field required' of the one it was meant to be
    "misspelt section": ("training:\n", "trainig:\n", "trainig: unknown key"),
}


def refuses_recipe_edit(sandbox, capsys, verb: str, old: str, new: str, key: str, text: str = RECIPE_TEXT) -> None:
    """The recipe (`text`) with `old` replaced by `new`, given to `verb`: refused in one line naming `key`, nothing
    written."""
    assert old in text
    recipe = sandbox / "recipe.yaml"
    recipe.write_text(text.replace(old, new, 1))
    before = _snapshot(sandbox)
    argv = {"generate": ["generate", str(recipe), "--out", str(sandbox / "gen")],
            "slurm render": ["slurm", "render", str(recipe)],
            "k8s render": ["k8s", "render", str(recipe), "--kind", "pytorchjob", "--image", "reg.io/dmt:1"],
            "restore-test": ["restore-test", "--recipe", str(recipe), "--workdir", str(sandbox / "restore")]}[verb]
    code, err = _run(capsys, argv)
    _assert_refused(code, err, key)
    assert _snapshot(sandbox) == before


@pytest.mark.parametrize("case", sorted(RECIPE_VALUES))
@pytest.mark.parametrize("verb", ["generate", "slurm render", "k8s render", "restore-test"])
def test_a_wrong_recipe_value_names_its_key(sandbox, capsys, monkeypatch, tmp_path_factory, case, verb):
    scratch = tmp_path_factory.mktemp("tmp")  # the command's temp dir: no training run may have started there
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    refuses_recipe_edit(sandbox, capsys, verb, *RECIPE_VALUES[case])
    assert not list(sandbox.rglob("PWNED")) and not list(scratch.glob("dmt-restore-*"))


BLEND_DATA = ("  train_files: [{corpus}]\n",
              "  blend:\n    - {prefix: {prefix}, weight: 3}\n    - {prefix: {prefix}, weight: 1}\n  split: '90,10,0'\n")
# a blend recipe's line replaced -> the key the error must name, the verbs that refuse it (the prepared files are
# checked where they are read: training, and restore-test before it launches anything)
BLEND_VALUES = {
    "weight 0": ("weight: 3", "weight: 0", "data.blend.0.weight", "all"),
    "weight negative": ("weight: 1}", "weight: -1}", "data.blend.1.weight", "all"),
    "weight as text": ("weight: 3", "weight: heavy", "data.blend.0.weight", "all"),
    "split not numbers": ("split: '90,10,0'", "split: '90,x'", "data.split", "all"),
    "split four shares": ("split: '90,10,0'", "split: '90,5,4,1'", "data.split", "all"),
    "split all zero": ("split: '90,10,0'", "split: '0,0'", "data.split", "all"),
    "blend and train_files": ("  split:", "  train_files: [x.txt]\n  split:", "data", "all"),
    "no tokenizer path": ("    path: {tokenizer}\n", "", "data", "all"),
    "missing prefix": ("prefix: {prefix}, weight: 1", "prefix: {prefix}-gone, weight: 1", "data.blend.1.prefix",
                       "restore-test"),
    "other tokenizer": ("    path: {tokenizer}\n", "    path: {other}\n", "data.blend.0.prefix", "restore-test"),
    "token beyond the vocabulary": ("vocab_size: 512\n    max_position", "vocab_size: 300\n    max_position",
                                    "data.blend.0.prefix", "restore-test"),
    # values megatron_args.txt would carry as words of a shell's splitting: a line break, a blank, a flag, a pattern
    "prefix with a line break": ("prefix: {prefix}, weight: 1", 'prefix: "{prefix}\\n--load /tmp/x", weight: 1',
                                 "data.blend.1.prefix", "all"),
    "prefix with a blank": ("prefix: {prefix}, weight: 1", "prefix: '{prefix} /etc', weight: 1",
                            "data.blend.1.prefix", "all"),
    "prefix a flag": ("prefix: {prefix}, weight: 1", "prefix: --save, weight: 1", "data.blend.1.prefix", "all"),
    "prefix a pattern": ("prefix: {prefix}, weight: 1", "prefix: '/*', weight: 1", "data.blend.1.prefix", "all"),
    "cache_dir with a blank": ("split: '90,10,0'", "split: '90,10,0'\n  cache_dir: 'cache /etc'", "data.cache_dir",
                               "all"),
    # finite, but a sum of such weights overflows to inf and every share to nan
    "weight 1e300": ("weight: 3", "weight: 1e300", "data.blend.0.weight", "all"),
    "weight 1e-300": ("weight: 3", "weight: 1e-300", "data.blend.0.weight", "all"),
}


def _blend_inputs(sandbox: Path) -> dict:
    """A prepared prefix, the tokenizer it was prepared with, and a copy of that tokenizer with one file changed."""
    other = sandbox / "other-tokenizer"
    other.mkdir()
    for file in Path(DATA_TOKENIZER).iterdir():
        (other / file.name).write_bytes(file.read_bytes())
    (other / "tokenizer_config.json").write_text((other / "tokenizer_config.json").read_text() + "\n")
    return {"prefix": _prepared(sandbox), "tokenizer": DATA_TOKENIZER, "other": other}


def _fill(text: str, names: dict) -> str:
    for name, value in names.items():
        text = text.replace(f"{{{name}}}", str(value))
    return text


def _blend_recipe(names: dict) -> str:
    """The tiny recipe training on a blend of the prepared prefix with itself, with the tokenizer it was made with."""
    text = RECIPE_TEXT.replace(_fill(BLEND_DATA[0], {"corpus": TINY.parent / "data/tiny_corpus.txt"}),
                               _fill(BLEND_DATA[1], names))
    return text.replace("  tokenizer:\n    vocab_size: 512\n", f"  tokenizer:\n    path: {DATA_TOKENIZER}\n")


def test_a_sound_blend_generates_its_data_path(sandbox, capsys):
    """The recipe the cases below break: generated whole, its prefixes in megatron_args.txt."""
    names = _blend_inputs(sandbox)
    recipe = sandbox / "blend.yaml"
    recipe.write_text(_blend_recipe(names))
    assert main(["generate", str(recipe), "--out", str(sandbox / "gen"), "--backend", "megatron", "--zero", "0"]) == 0
    capsys.readouterr()
    args = (sandbox / "gen" / "megatron_args.txt").read_text().splitlines()
    dataset = f"{names['prefix']}_text_document"
    assert f"--data-path 3.0 {dataset} 1.0 {dataset}" in args and "--split 90,10,0" in args


@pytest.mark.parametrize("case,verb", [(case, verb) for case in sorted(BLEND_VALUES)
                                       for verb in ("generate", "slurm render", "k8s render", "restore-test")
                                       if BLEND_VALUES[case][3] in ("all", verb)])
def test_a_wrong_blend_names_its_key(sandbox, capsys, monkeypatch, tmp_path_factory, case, verb):
    """data.blend and data.split as a user gets them wrong: pydantic's rules refuse at every verb; the prepared files
    (missing, another tokenizer's, ids beyond the model's vocabulary) before the restore test launches anything."""
    old, new, key, _ = BLEND_VALUES[case]
    scratch = tmp_path_factory.mktemp("tmp")
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    names = _blend_inputs(sandbox)
    refuses_recipe_edit(sandbox, capsys, verb, _fill(old, names), _fill(new, names), key, _blend_recipe(names))
    assert not list(scratch.glob("dmt-restore-*"))


def test_a_sidecar_that_does_not_describe_its_files_is_not_trusted_for_token_ids(sandbox, capsys, monkeypatch,
                                                                                   tmp_path_factory):
    """The sidecar's max_token_id spares reading the .bin, but only where its counts are the .idx's: a sidecar
    edited (or left beside other files) saying max_token_id 0 does not let ids beyond the vocabulary through to an
    embedding's IndexError; the .bin is read and the prefix refused before the restore test launches anything."""
    scratch = tmp_path_factory.mktemp("tmp")
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    names = _blend_inputs(sandbox)
    record = Path(f"{names['prefix']}.dmt.json")
    data = json.loads(record.read_text())
    data["datasets"]["text"].update(max_token_id=0, documents=data["datasets"]["text"]["documents"] + 1)
    record.write_text(json.dumps(data))
    refuses_recipe_edit(sandbox, capsys, "restore-test", "vocab_size: 512\n    max_position",
                        "vocab_size: 300\n    max_position", "data.blend.0.prefix", _blend_recipe(names))
    assert not list(scratch.glob("dmt-restore-*"))


def test_a_sidecar_whose_max_token_id_alone_is_false_is_caught_in_the_first_batch(sandbox):
    """Its counts the .idx's, its max_token_id false (0): check_blend believes it (what the sidecar is for: no .bin
    read at start on every rank), but every batch training reads is checked against the vocabulary where it is read
    (TokenBound: a max over the batch; the Megatron loop's batches with their dataset ids, the HF Trainer's input_ids
    without), and one past it is one line naming the prefix's key, the token and the false record, not an
    embedding's IndexError (a device-side assert on a GPU)."""
    from toolkit.backends.megatron.convert import single_process_group
    from toolkit.data.blend import TokenBound, build_datasets, check_blend, stack_samples
    from toolkit.errors import UserInputError
    from toolkit.spec.recipe import load_recipe

    names = _blend_inputs(sandbox)
    record = Path(f"{names['prefix']}.dmt.json")
    data = json.loads(record.read_text())
    largest, vocab = data["datasets"]["text"]["max_token_id"], 300
    assert largest >= vocab
    data["datasets"]["text"]["max_token_id"] = 0
    record.write_text(json.dumps(data))
    (sandbox / "blend.yaml").write_text(_blend_recipe(names))
    recipe = load_recipe(sandbox / "blend.yaml")
    sources = check_blend(recipe, vocab)  # believed
    with single_process_group():  # Megatron-Core's dataset builder asks the rank
        train, _ = build_datasets(recipe, 64, 16, sandbox / "run", vocab)
    batch = stack_samples([train[index] for index in range(8)])
    assert "dataset_id" in batch and int(batch["tokens"].max()) >= vocab
    for ids in (batch["dataset_id"], None):
        with pytest.raises(UserInputError) as refused:
            train.bound.check(batch["tokens"], ids)
        key, message = refused.value.key, refused.value.message
        assert key in ("data.blend.0.prefix", "data.blend.1.prefix") and str(names["prefix"]) in message, message
        assert f"token id {int(batch['tokens'].max())}" in message and "max_token_id 0" in message, message
        assert "\n" not in str(refused.value)
    TokenBound(largest + 1, tuple(sources)).check(batch["tokens"], batch["dataset_id"])  # a true bound: no word


# megatron.yaml of the sound blend recipe edited by hand: (section, key, value) -> the key `dmt validate` names
MEGATRON_YAML_EDITS = {
    "prefix with a line break": (("data", "blend", 0, "prefix"), "corpus\n--load /tmp/x", "data.blend[0].prefix"),
    "prefix with a blank": (("data", "blend", 1, "prefix"), "corpus /etc", "data.blend[1].prefix"),
    "weight a flag": (("data", "blend", 0, "weight"), "--save", "data.blend[0].weight"),
    "weight 1e300": (("data", "blend", 0, "weight"), 1e300, "data.blend[0].weight"),
    "cache_dir a pattern": (("data", "cache_dir"), "/*", "data.cache_dir"),
    "split with a line break": (("data", "split"), "90,10,0\n--load /tmp/x", "data.split"),
    "normalization with a blank": (("transformer_config", "normalization"), "RMSNorm --load /tmp/x",
                                   "transformer_config.normalization"),
}


@pytest.mark.parametrize("case", sorted(MEGATRON_YAML_EDITS))
def test_a_hand_edited_megatron_yaml_that_would_inject_flags_is_refused(sandbox, capsys, case):
    """`dmt validate` of a megatron.yaml whose value would add a line, a flag or a word to megatron_args.txt."""
    import yaml

    where, value, key = MEGATRON_YAML_EDITS[case]
    recipe = sandbox / "blend.yaml"
    recipe.write_text(_blend_recipe(_blend_inputs(sandbox)))
    assert main(["generate", str(recipe), "--out", str(sandbox / "gen"), "--backend", "megatron", "--zero", "0"]) == 0
    capsys.readouterr()
    path = sandbox / "gen" / "megatron.yaml"
    config = yaml.safe_load(path.read_text())
    assert main(["validate", str(path), "--world-size", str(config["schedule"]["world_size"])]) == 0
    capsys.readouterr()
    *parents, last = where
    target = config
    for part in parents:
        target = target[part]
    target[last] = value
    path.write_text(yaml.safe_dump(config))
    before = _snapshot(sandbox)
    code, err = _run(capsys, ["validate", str(path), "--world-size", str(config["schedule"]["world_size"])])
    _assert_refused(code, err, key)
    assert _snapshot(sandbox) == before


def _prepared(directory: Path) -> Path:
    """A prefix `dmt data prepare` made of the golden corpus, in `directory`."""
    prefix = directory / "corpus"
    assert main(["data", "prepare", "--input", DATA_CORPUS, "--tokenizer", DATA_TOKENIZER, "--output-prefix",
                 str(prefix), "--workers", "1"]) == 0
    return prefix


def _damage(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


DAMAGED_DATASETS = {  # how a prepared dataset is damaged -> the file and the words the one line must hold
    "truncated .bin": (lambda p: Path(f"{p}.bin").write_bytes(Path(f"{p}.bin").read_bytes()[:-7]), ".bin", "truncated"),
    "longer .bin": (lambda p: Path(f"{p}.bin").write_bytes(Path(f"{p}.bin").read_bytes() + b"\0\0"), ".bin",
                    "longer than its index says"),
    "wrong magic": (lambda p: _damage(Path(f"{p}.idx"), 0, b"NOTANIDX\0"), ".idx", "magic"),
    "wrong version": (lambda p: _damage(Path(f"{p}.idx"), 9, (2).to_bytes(8, "little")), ".idx", "version 2"),
    "unknown dtype": (lambda p: _damage(Path(f"{p}.idx"), 17, b"\x63"), ".idx", "dtype code 99"),
    "truncated .idx": (lambda p: Path(f"{p}.idx").write_bytes(Path(f"{p}.idx").read_bytes()[:-8]), ".idx",
                       "truncated or damaged"),
    "header only": (lambda p: Path(f"{p}.idx").write_bytes(Path(f"{p}.idx").read_bytes()[:20]), ".idx",
                    "less than an index header"),
    "missing .idx": (lambda p: Path(f"{p}.idx").unlink(), ".idx", "is missing"),
    "missing .bin": (lambda p: Path(f"{p}.bin").unlink(), ".bin", "is missing"),
    "sidecar damaged": (lambda p: Path(str(p).rsplit("_text_document", 1)[0] + ".dmt.json").write_text("{"),
                        ".dmt.json", "not valid JSON"),
    "a pointer past the .bin": (lambda p: _damage(Path(f"{p}.idx"), _pointer_offset(p, 1), (10**9).to_bytes(8, "little")),
                                ".idx", "sequence 1's pointer is byte 1000000000"),
    "zero documents": (lambda p: _empty_dataset(p), ".idx", "holds no documents"),
}


def _pointer_offset(prefix: Path, sequence: int) -> int:
    """Where sequence `sequence`'s pointer lies in the .idx (after the 34-byte header and the int32 lengths)."""
    sequences = int.from_bytes(Path(f"{prefix}.idx").read_bytes()[18:26], "little")
    return 34 + sequences * 4 + sequence * 8


def _empty_dataset(prefix: Path) -> None:
    """A sound pair of no documents: the header with 0 sequences and the document index's leading 0 alone."""
    head = Path(f"{prefix}.idx").read_bytes()[:18]  # magic, version, dtype code
    Path(f"{prefix}.idx").write_bytes(head + (0).to_bytes(8, "little") + (1).to_bytes(8, "little") + bytes(8))
    Path(f"{prefix}.bin").write_bytes(b"")


@pytest.mark.parametrize("case", sorted(DAMAGED_DATASETS))
def test_a_damaged_prepared_dataset_is_one_line_naming_the_file(sandbox, capsys, case):
    damage, suffix, says = DAMAGED_DATASETS[case]
    prefix = _prepared(sandbox)
    dataset = Path(f"{prefix}_text_document")
    damage(dataset)
    capsys.readouterr()
    before = _snapshot(sandbox)
    code, err = _run(capsys, ["data", "inspect", str(prefix)])
    named = f"{prefix}.dmt.json" if suffix == ".dmt.json" else f"{dataset}{suffix}"
    _assert_refused(code, err, "PREFIX", named, says)
    assert _snapshot(sandbox) == before


def _outrange_cache(sandbox: Path, prefix: Path) -> None:
    """The blend's index cache built once as training builds it, then one dataset index pointing past its datasets."""
    import numpy

    _train_loader(sandbox)
    cache = sorted((sandbox / "run").rglob("*-BlendedDataset-train-dataset_index.npy"))[0]
    numpy.save(cache, numpy.full_like(numpy.load(cache), 100))


LOADER_CASES = {  # how the blend's inputs are damaged -> the key and the words the training loader's one line holds
    "index cache values out of range": (_outrange_cache, "data.cache_dir", "outside 0 to 1"),
    "a pointer past the .bin": (lambda sandbox, p: DAMAGED_DATASETS["a pointer past the .bin"][0](p),
                                "data.blend.0.prefix", "sequence 1's pointer is byte 1000000000"),
    "zero documents": (lambda sandbox, p: _empty_dataset(p), "data.blend.0.prefix", "holds no documents"),
}


def _train_loader(sandbox: Path) -> None:
    """What every rank runs before its first step (check_blend, then Megatron-Core's blended datasets with the index
    cache under the run directory), and the first samples read."""
    from toolkit.backends.megatron.convert import single_process_group
    from toolkit.data.blend import build_datasets, check_blend
    from toolkit.spec.recipe import load_recipe

    recipe = load_recipe(sandbox / "blend.yaml")
    check_blend(recipe, 512)
    with single_process_group():
        train, _ = build_datasets(recipe, 64, 16, sandbox / "run", 512)
    [train[i] for i in range(4)]


@pytest.mark.parametrize("case", sorted(LOADER_CASES))
def test_the_training_loader_refuses_a_damaged_dataset_or_cache_in_one_line(sandbox, case):
    """A foreign index cache whose values pass the dtype check, or a prepared dataset of zero documents or pointers
    past its .bin, is one line naming the key before a rank reads a sample (data inspect's cases are above)."""
    from test_fuzz_checkpoints import _refused

    names = _blend_inputs(sandbox)
    (sandbox / "blend.yaml").write_text(_blend_recipe(names))
    damage, key, says = LOADER_CASES[case]
    damage(sandbox, Path(f"{names['prefix']}_text_document"))
    line = _refused(bounded(lambda: _train_loader(sandbox) or 0), key, says)
    assert line.startswith(f"dmt: error: {key}: "), line


FLAG_VALUES = [  # argv -> the flag the error must name
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "0"], "--seq-len"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--recompute-modules", "core_attn,all"],
     "--recompute-modules"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--train-tokens", "many"], "--train-tokens"),
    (["plan", "--model", "llama-3.1-8b", "--gpus", "0", "--seq-len", "512", "--global-batch", "8"], "--gpus"),
    (["estimate", "--model", "{recipe}", "--gpus", "8"], "--model"),  # a recipe is no model spec: said so, in one line
    # long-context options (spec/options.py): bad values, and the libraries' rules
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--sp", "0"], "--sp"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--sp", "two"], "--sp"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "6", "--sp", "3"], "--sp"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--sp", "2", "--backend", "fsdp"], "--sp"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--cp", "2"], "--cp"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--backend", "fsdp", "--cp", "4", "--seq-len", "4100"],
     "--seq-len"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--sp", "2", "--attention", "eager"], "--attention"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--attention", "flash_attention_2", "--backend",
      "megatron"], "--attention"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--attention", "flash_attention_2", "--precision",
      "fp32"], "--attention"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--data-recipe", "no-such-recipe.yaml"],
     "--data-recipe"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--offload-activations", "nvme"], "--offload-activations"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--offload-activations", "cpu"], "--offload-activations"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--tiled-mlp", "--backend", "megatron"], "--tiled-mlp"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--max-seq-len", "--seq-len", "4096"], "--seq-len"),
    (["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--host-memory-gb", "-1"], "--host-memory-gb"),
    (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--global-batch", "8"], "--seq-len"),
    (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "512", "--global-batch", "8", "--top", "0"],
     "--top"),
    (["slurm", "render", "{recipe}", "--output-dir", "runs\n#SBATCH --qos=high/x"], "--output-dir"),
    (["slurm", "render", "{recipe}", "--time", "1 day"], "--time"),
    (["slurm", "render", "{recipe}", "--time", "24:00:00\n"], "--time"),  # the value quoted may add no line
    # an empty value (`--queue "$QUEUE"` with QUEUE unset) is a mistake, never read as "not given"
    (["slurm", "render", "{recipe}", "--output-dir", ""], "--output-dir"),
    (["k8s", "render", "{recipe}", "--kind", "jobset", "--image", "reg.io/dmt:1", "--queue", ""], "--queue"),
    (["k8s", "render", "{recipe}", "--kind", "jobset", "--image", "reg.io/dmt:1", "--namespace", ""], "--namespace"),
    (["k8s", "render", "{recipe}", "--kind", "jobset", "--image", "reg.io/dmt:1", "--checkpoint-pvc", ""],
     "--checkpoint-pvc"),
    (["k8s", "render", "{recipe}", "--kind", "jobset", "--image", "reg.io/dmt:1\nkind: Secret"], "--image"),
    (["k8s", "render", "{recipe}", "--kind", "cronjob", "--image", "reg.io/dmt:1"], "--kind"),
    (["k8s", "render", "{recipe}", "--kind", "jobset", "--image", "reg.io/dmt:1", "--namespace", "$(id)"],
     "--namespace"),
    # a trailing newline (a pattern's `$` under re.match would let it through) is part of no Kubernetes name
    *((["k8s", "render", "{recipe}", "--kind", "jobset", "--image", "reg.io/dmt:1", flag, "team-a\n"], flag)
      for flag in ("--namespace", "--queue", "--checkpoint-pvc")),
    (["k8s", "render", "{recipe}", "--kind", "jobset", "--image", "reg.io/dmt:1\n"], "--image"),
    (["restore-test", "--recipe", "{recipe}", "--steps", "0"], "--steps"),
    (["restore-test", "--recipe", "{recipe}", "--steps", "-5"], "--steps"),
    (["restore-test", "--recipe", "{recipe}", "--backend", "megatron", "--steps", "2"], "--steps"),
    (["restore-test", "--recipe", "{recipe}", "--save-at", "30"], "--save-at"),
    (["restore-test", "--recipe", "{recipe}", "--timeout", "0"], "--timeout"),
    (["validate", "{ds}", "--world-size", "0"], "--world-size"),
    (["health", "--nproc", "0"], "--nproc"),
    (["explore", "--port", "70000"], "--port"),
    (["report", "{ds}", "--warmup", "-1"], "--warmup"),
    (["calibrate", "{ds}", "--out", "{ds}.yaml", "--warmup", "-2"], "--warmup"),
    (["data", "prepare", "--input", DATA_CORPUS, "--tokenizer", DATA_TOKENIZER, "--output-prefix", "{ds}.out",
      "--workers", "0"], "--workers"),
    (["data", "prepare", "--input", DATA_CORPUS, "--tokenizer", DATA_TOKENIZER, "--output-prefix", "{ds}.out",
      "--json-keys", "text", "a/b"], "--json-keys"),
    (["data", "prepare", "--input", DATA_CORPUS, "--tokenizer", DATA_TOKENIZER, "--output-prefix", "{ds}.out",
      "--json-keys", "text", "text"], "--json-keys"),
    (["data", "prepare", "--input", DATA_CORPUS, "--tokenizer", DATA_TOKENIZER, "--output-prefix", "{ds}.out",
      "--json-keys", "body"], "--json-keys"),
    (["data", "prepare", "--input", DATA_CORPUS, "--tokenizer", DATA_TOKENIZER, "--output-prefix", "{ds}.out",
      "--json-keys", "text,title"], "--json-keys text title"),  # one key per word, said so
    (["data", "prepare", "--input", "{ds}", "--tokenizer", DATA_TOKENIZER, "--output-prefix", "{ds}.out"],
     "--input"),
    (["data", "inspect", ""], "PREFIX"),
]


@pytest.mark.parametrize("argv, flag", FLAG_VALUES, ids=[f"{a[0]}{a[-2]}" for a, _ in FLAG_VALUES])
def test_a_wrong_flag_value_names_the_flag(sandbox, capsys, argv, flag):
    before = _snapshot(sandbox)
    code, err = _run(capsys, [part.format(recipe=sandbox / "recipe.yaml", ds=sandbox / "ds.json") for part in argv])
    _assert_refused(code, err, flag)
    assert err[-1].startswith("dmt "), err  # the error is the last line, whole: no value adds a line of its own
    assert _snapshot(sandbox) == before


def test_tables_read_through_a_pipe_keep_every_value_whole(tmp_path):
    """Off a terminal the table is as wide as its content: a long model path and the plan labels arrive whole."""
    import subprocess
    import sys

    from helpers import tiny_llama_config

    deep = tmp_path / ("a-directory-name-long-enough-to-be-cut-by-any-eighty-or-140-column-table-" * 2)
    deep.mkdir()
    (deep / "config.json").write_text(json.dumps(tiny_llama_config()))
    for argv in (["estimate", "--model", str(deep), "--gpus", "2", "--seq-len", "128"],
                 ["plan", "--model", str(deep), "--gpus", "16", "--seq-len", "128", "--global-batch", "16",
                  "--top", "20"]):
        result = subprocess.run([sys.executable, "-m", "toolkit", *argv], capture_output=True, text=True,
                                timeout=FUZZ_HANG_GUARD_S)
        assert result.returncode == 0, result.stderr
        assert deep.name in result.stdout and "…" not in result.stdout, result.stdout


def test_validate_and_generate_read_through_a_pipe_keep_every_path_whole(tmp_path):
    """The other verbs that print results (not tables: one line a result) through a real pipe: every path whole."""
    import subprocess
    import sys

    from helpers import TINY

    deep = tmp_path / ("a-directory-name-long-enough-to-be-cut-by-any-eighty-or-140-column-table-" * 2)
    recipe = deep / "recipe.yaml"
    deep.mkdir()
    recipe.write_text(TINY.read_text().replace("data/tiny_corpus.txt", str(TINY.parent / "data/tiny_corpus.txt")))
    for argv, says in ((["generate", str(recipe), "--out", str(deep / "gen")], f"wrote {deep / 'gen' / 'launch.sh'}"),
                       (["validate", str(deep / "gen" / "deepspeed.json"), "--world-size", "2"],
                        f"{deep / 'gen' / 'deepspeed.json'}: valid for world size 2")):
        result = subprocess.run([sys.executable, "-m", "toolkit", *argv], capture_output=True, text=True,
                                timeout=FUZZ_HANG_GUARD_S)
        assert result.returncode == 0, result.stderr
        assert says in result.stdout.splitlines() or any(line.strip() == says for line in result.stdout.splitlines()), \
            result.stdout
