"""What the toolkit may delete and overwrite: `dmt generate` removes only files its generators wrote, directly in
--out and unchanged since, whatever its record `.dmt-generated.json` says; and no output of any verb replaces one of
that verb's inputs, named directly, through a symlink, or as a file inside an input directory."""

import hashlib
import json
from pathlib import Path

import pytest
from test_calibration import _calibration_file
from test_fuzz_verbs import RECIPE_TEXT, _assert_refused, _run, _snapshot, sandbox  # noqa: F401 (a fixture)

from helpers import TINY, tiny_llama_config
from toolkit.cli.main import main
from toolkit.generate.files import GENERATED
from toolkit.outputs import RECORD

MEGATRON_TEXT = RECIPE_TEXT.replace("backend: deepspeed\n  zero: 2", "backend: megatron")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _generated(sandbox: Path, capsys) -> Path:
    """A directory `dmt generate` wrote for the DeepSpeed recipe, with the user's notes beside its files."""
    out = sandbox / "gen"
    assert main(["generate", str(sandbox / "recipe.yaml"), "--out", str(out)]) == 0
    (out / "notes.txt").write_text("the user's notes\n")
    capsys.readouterr()
    return out


def _plant(out: Path, entries: dict[str, str]) -> None:
    """Edit the record as someone else might: extra entries beside what generate wrote."""
    record = json.loads((out / RECORD).read_text())
    (out / RECORD).write_text(json.dumps({**record, **entries}))


# A hostile record entry: what it names, made to match (the victim's own sha256), and whether --force is given
def _outside(sandbox: Path, out: Path) -> tuple[str, Path]:
    victim = sandbox / "outside.txt"
    victim.write_text("outside --out\n")
    return "../outside.txt", victim


def _notes(sandbox: Path, out: Path) -> tuple[str, Path]:
    return "notes.txt", out / "notes.txt"


def _absolute(sandbox: Path, out: Path) -> tuple[str, Path]:
    victim = sandbox / "absolute.txt"
    victim.write_text("named by its absolute path\n")
    return str(victim), victim


def _symlink(sandbox: Path, out: Path) -> tuple[str, Path]:
    """A generator's name (megatron.yaml: not written for DeepSpeed, so stale) that is a link to the user's file."""
    victim = sandbox / "precious.yaml"
    victim.write_text("the user's megatron.yaml, kept elsewhere\n")
    (out / "megatron.yaml").symlink_to(victim)
    return "megatron.yaml", victim


def _through_a_directory(sandbox: Path, out: Path) -> tuple[str, Path]:
    (out / "run").mkdir()
    victim = out / "run" / "megatron.yaml"
    victim.write_text("a file of the user's run\n")
    return "run/megatron.yaml", victim


HOSTILE_ENTRIES = {"../outside.txt": _outside, "the user's notes.txt": _notes, "an absolute path": _absolute,
                   "a symlink to outside": _symlink, "a path through a directory": _through_a_directory}


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize("case", sorted(HOSTILE_ENTRIES))
def test_a_record_naming_what_generate_did_not_write_removes_nothing(sandbox, capsys, case, force):
    """The record lists a file with its true sha256; generate runs again (the same recipe: every recorded name that
    is not rewritten would be removed as stale); the file stays, byte for byte, and so does a symlink."""
    out = _generated(sandbox, capsys)
    name, victim = HOSTILE_ENTRIES[case](sandbox, out)
    before = victim.read_bytes()
    _plant(out, {name: _sha(victim)})
    code, err = _run(capsys, ["generate", str(sandbox / "recipe.yaml"), "--out", str(out), *(["--force"] * force)])
    assert code == 0, err
    assert victim.read_bytes() == before
    assert (out / "notes.txt").read_text() == "the user's notes\n"
    if case == "a symlink to outside":
        assert (out / "megatron.yaml").is_symlink()
    assert name not in json.loads((out / RECORD).read_text())  # the new record lists what was written, only


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
def test_a_generated_file_the_user_edited_is_kept_when_the_backend_changes(sandbox, capsys, force):
    """Generated for DeepSpeed, then for Megatron-Core: the DeepSpeed files go, except deepspeed.json, which the user
    edited since (its content no longer has the recorded hash): it stays, with or without --force."""
    out = _generated(sandbox, capsys)
    (out / "deepspeed.json").write_text('{"edited": "by the user"}\n')
    megatron = sandbox / "megatron.yaml"
    megatron.write_text(MEGATRON_TEXT)
    code, err = _run(capsys, ["generate", str(megatron), "--out", str(out), *(["--force"] * force)])
    assert code == 0, err
    assert (out / "deepspeed.json").read_text() == '{"edited": "by the user"}\n'
    names = {p.name for p in out.iterdir()}
    assert {"megatron.yaml", "plan.json", "notes.txt"} <= names
    assert not names & {"accelerate.yaml", "trainer_args.json"}  # unchanged since generate wrote them: removed


def test_the_names_a_record_may_remove_are_the_generators_own():
    from toolkit.generate.files import COMMON, files_of
    from toolkit.spec.backends import BACKENDS

    assert GENERATED == {name for backend in BACKENDS for name in files_of(backend)}
    # each backend's declared files are the ones its generator writes
    assert all(set(files_of(name)) == set(COMMON) | set(b.files) for name, b in BACKENDS.items())
    assert all(Path(name).name == name and name not in (".", "..") for name in GENERATED)


# A record that is not one: (what is written as the record, how)
DAMAGED_RECORDS = {
    "not JSON": lambda p: p.write_text('{"plan.json": '),
    "a list": lambda p: p.write_text('["deepspeed.json"]'),
    "a hash that is not one": lambda p: p.write_text('{"deepspeed.json": 42}'),
    "a directory": lambda p: p.mkdir(),
    "a symlink to the user's file": lambda p: p.symlink_to(p.parent.parent / "recipe.yaml"),
    "binary": lambda p: p.write_bytes(bytes(range(256)) * 4),
}


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize("case", sorted(DAMAGED_RECORDS))
def test_a_damaged_record_is_one_line_and_nothing_is_removed(sandbox, capsys, case, force):
    out = _generated(sandbox, capsys)
    (out / RECORD).unlink()
    DAMAGED_RECORDS[case](out / RECORD)
    megatron = sandbox / "megatron.yaml"  # a backend change: every DeepSpeed file would be stale
    megatron.write_text(MEGATRON_TEXT)
    before = _snapshot(sandbox)
    code, err = _run(capsys, ["generate", str(megatron), "--out", str(out), *(["--force"] * force)])
    _assert_refused(code, err, "--out", RECORD)
    assert len(err) == 1
    assert _snapshot(sandbox) == before


# --- no output over an input ---------------------------------------------------------------------------------------
# verb -> (argv with {in} for the input and {out} for the output, the output's flag, the input as given (relative to
# the sandbox), the file the output names (relative), and whether the input is named by a flag (a symlinked input
# then makes sense) or found through another file (a recipe's data, a generated directory's files)
OVER_INPUTS = {
    "plan --plot over --model": (["plan", "--model", "{in}", "--gpus", "8", "--seq-len", "512", "--global-batch",
                                  "8", "--plot", "{out}"], "--plot", "m.png", "m.png", True),
    "plan --plot over --calibration": (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "512",
                                        "--global-batch", "8", "--calibration", "{in}", "--plot", "{out}"], "--plot",
                                       "c.png", "c.png", True),
    "plan --plot over --measured-bw": (["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "512",
                                        "--global-batch", "8", "--measured-bw", "{in}", "--plot", "{out}"], "--plot",
                                       "h.png", "h.png", True),
    "report --plot over --calibration": (["report", "{run}", "--calibration", "{in}", "--plot", "{out}"], "--plot",
                                         "c.png", "c.png", True),
    "report --plot over a file in RUN_DIR": (["report", "{in}", "--plot", "{out}"], "--plot", "run", "run/loss.png",
                                             True),
    "calibrate --out over a file in RUN_DIR": (["calibrate", "{in}", "--out", "{out}"], "--out", "run",
                                               "run/metrics.jsonl", True),
    "calibrate --out over --health": (["calibrate", "{run}", "--health", "{in}", "--out", "{out}"], "--out",
                                      "health.json", "health.json", True),
    "slurm render --out over RECIPE": (["slurm", "render", "{in}", "--out", "{out}"], "--out", "recipe.yaml",
                                       "recipe.yaml", True),
    "slurm render --out over --deepspeed": (["slurm", "render", "{recipe}", "--deepspeed", "{in}", "--out", "{out}"],
                                            "--out", "ds.json", "ds.json", True),
    "slurm render --out over --accelerate-config": (["slurm", "render", "{recipe}", "--launcher", "accelerate",
                                                     "--accelerate-config", "{in}", "--out", "{out}"], "--out",
                                                    "accelerate.yaml", "accelerate.yaml", True),
    "slurm render --out over the recipe's data": (["slurm", "render", "{recipe}", "--out", "{out}"], "--out",
                                                  "corpus.txt", "corpus.txt", False),
    "generate --out holding RECIPE as launch.sh": (["generate", "{in}", "--out", "{out}"], "--out", "job/launch.sh",
                                                   "job", True),
    "generate --out holding --calibration as plan.json": (["generate", "{recipe}", "--calibration", "{in}", "--out",
                                                           "{out}"], "--out", "job/plan.json", "job", True),
    "restore-test --workdir holding RECIPE as a log": (["restore-test", "--recipe", "{in}", "--workdir", "{out}"],
                                                       "--workdir", "work/reference.log", "work", True),
    "convert zero-to-hf OUT_DIR over CKPT_DIR": (["convert", "zero-to-hf", "{in}", "{out}"], "OUT_DIR", "ckpt",
                                                 "ckpt", True),
    "convert hf-to-megatron OUT_DIR over HF_DIR": (["convert", "hf-to-megatron", "{in}", "{out}"], "OUT_DIR",
                                                   "ckpt", "ckpt", True),
    "convert megatron-to-hf OUT_DIR over MEGATRON_DIR": (["convert", "megatron-to-hf", "{in}", "{out}"], "OUT_DIR",
                                                         "ckpt", "ckpt", True),
    "convert fsdp-to-hf OUT_DIR over CKPT": (["convert", "fsdp-to-hf", "{in}", "{out}"], "OUT_DIR", "ckpt", "ckpt",
                                             True),
    "convert merge-lora OUT_DIR over ADAPTER": (["convert", "merge-lora", "{run}", "{in}", "{out}"], "OUT_DIR",
                                                "ckpt", "ckpt", True),
}


def _users_files(sandbox: Path) -> None:
    """What the user has: a model config, a calibration, a health report, a run directory, an accelerate config, a
    checkpoint directory, a corpus the recipe trains on (the recipe names it), files in a job directory."""
    (sandbox / "m.png").write_text(json.dumps(tiny_llama_config()))
    _calibration_file(sandbox / "c.png", hardware="h100-80gb")
    (sandbox / "h.png").write_text('{"bandwidth": {"intra_node_busbw_gbps": 100}}\n')
    (sandbox / "health.json").write_text('{"bandwidth": {"intra_node_busbw_gbps": 100}}\n')
    run = sandbox / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 6.2}\n')
    (run / "loss.png").write_bytes(b"\x89PNG a plot the user keeps")
    (sandbox / "accelerate.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    (sandbox / "ckpt").mkdir()
    (sandbox / "ckpt" / "latest").write_text("global_step10\n")
    (sandbox / "corpus.txt").write_text((TINY.parent / "data" / "tiny_corpus.txt").read_text())
    (sandbox / "recipe.yaml").write_text(RECIPE_TEXT.replace(str(TINY.parent / "data/tiny_corpus.txt"), "corpus.txt"))
    (sandbox / "job").mkdir()
    (sandbox / "job" / "launch.sh").write_text((sandbox / "recipe.yaml").read_text())
    _calibration_file(sandbox / "job" / "plan.json", hardware="cpu")  # for the recipe's hardware: the host
    (sandbox / "work").mkdir()
    (sandbox / "work" / "reference.log").write_text((sandbox / "recipe.yaml").read_text())


@pytest.mark.parametrize("via", ["as-named", "output-a-symlink", "input-a-symlink"])
@pytest.mark.parametrize("case", sorted(OVER_INPUTS))
def test_no_output_replaces_an_input(sandbox, capsys, case, via):
    argv_template, flag, given, target, named = OVER_INPUTS[case]
    if via == "input-a-symlink" and not named:
        pytest.skip("found through the recipe, not named on the command line")
    _users_files(sandbox)
    source, out = sandbox / given, sandbox / target
    if via == "output-a-symlink":
        out = sandbox / f"alias-{out.name}"
        out.symlink_to(sandbox / target)
    elif via == "input-a-symlink":
        source = sandbox / f"link-{source.name}"
        source.symlink_to(sandbox / given)
    before = _snapshot(sandbox)
    argv = [part.format(**{"in": source, "out": out, "run": sandbox / "run", "recipe": sandbox / "recipe.yaml"})
            for part in argv_template]
    code, err = _run(capsys, argv)
    # a link to an input the command finds only later (a recipe's data) is refused first as a link: no output is
    # written through one
    _assert_refused(code, err, flag, "symbolic link" if via == "output-a-symlink" and not named else "input")
    assert len(err) == 1, err
    assert _snapshot(sandbox) == before
    assert not [p for p in sandbox.rglob("*") if ".tmp-" in p.name]


def test_slurm_render_never_replaces_a_file_of_the_generated_directory_it_renders(sandbox, capsys):
    """--plan DIR/plan.json reads DIR's files (deepspeed.json, ...): --out over one of them is refused once rendering
    has read them, a link to one before (no output is written through a link), and the generated directory stays
    as generate wrote it."""
    out = _generated(sandbox, capsys)
    (sandbox / "alias.json").symlink_to(out / "deepspeed.json")
    before = _snapshot(sandbox)
    for target, says in ((out / "deepspeed.json", "input"), (sandbox / "alias.json", "symbolic link")):
        code, err = _run(capsys, ["slurm", "render", str(sandbox / "recipe.yaml"), "--plan", str(out / "plan.json"),
                                  "--out", str(target)])
        _assert_refused(code, err, "--out", "deepspeed.json", says)  # a link: refused as one before rendering
        assert _snapshot(sandbox) == before


def test_an_output_beside_the_inputs_is_written(sandbox, capsys):
    """The check refuses what replaces an input, nothing more: a new plot in a run directory it reads is written."""
    _users_files(sandbox)
    code, err = _run(capsys, ["plan", "--model", str(sandbox / "m.png"), "--gpus", "8", "--seq-len", "512",
                              "--global-batch", "8", "--top", "2", "--plot", str(sandbox / "run" / "plan.png")])
    assert code == 0, err
    assert (sandbox / "run" / "plan.png").read_bytes().startswith(b"\x89PNG")
    assert (sandbox / "m.png").read_text() == json.dumps(tiny_llama_config())


def test_every_path_flag_says_whether_it_is_read_or_written():
    """A flag whose value is a path takes one of toolkit.cli.paths' types, never a bare Path: the ones read register
    as the command's inputs, so a new flag is compared with every output without its verb listing it."""
    import argparse

    from toolkit.cli.main import VERBS, build_parser

    bare = []
    for verb in VERBS:
        parsers = [build_parser(verb)._subparsers._group_actions[0].choices[verb]]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    parsers += action.choices.values()
                elif action.type is Path or isinstance(action.type, argparse.FileType):
                    bare.append(f"{verb} {'/'.join(action.option_strings) or action.dest}")
    assert not bare, bare


# trainer_args.json edited by hand where it sends something elsewhere -> the key the one line names
OUTWARD_EDITS = {
    "push to the hub": ({"push_to_hub": True}, "push_to_hub"),
    "a hub model id": ({"hub_model_id": "someone/weights"}, "hub_model_id"),
    "report to wandb": ({"report_to": ["wandb"]}, "report_to"),
    "report to everything": ({"report_to": "all"}, "report_to"),
}


@pytest.mark.parametrize("case", sorted(OUTWARD_EDITS))
def test_a_hand_edit_that_sends_the_run_elsewhere_is_refused_before_training(sandbox, capsys, case):
    """training reads a generated directory through read_generated, as `dmt slurm render --plan` does: an edit of
    trainer_args.json that would upload the weights or report the metrics to a service the recipe does not name is
    one line naming the file and the key, at the verb and before any training starts."""
    from toolkit.errors import UserInputError
    from toolkit.validate.generated import read_generated

    edit, key = OUTWARD_EDITS[case]
    out = _generated(sandbox, capsys)
    read_generated(out / "plan.json")  # as generated: accepted, report_to "none" as the recipe says
    path = out / "trainer_args.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(UserInputError, match=key) as refused:
        read_generated(out / "plan.json")
    assert refused.value.key == str(path) and "\n" not in str(refused.value)
    before = _snapshot(sandbox)
    code, err = _run(capsys, ["slurm", "render", str(sandbox / "recipe.yaml"), "--plan", str(out)])
    _assert_refused(code, err, "trainer_args.json", key)
    assert _snapshot(sandbox) == before
