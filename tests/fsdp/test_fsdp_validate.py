"""`dmt validate accelerate.yaml`: a corpus of broken FSDP configs (with trainer arguments where the rule needs them),
each with its own one-line message and the key at fault; the generated files and the committed examples pass."""

import json
from pathlib import Path

import pytest

from toolkit.cli.main import main
from toolkit.generate.fsdp_examples import EXAMPLES, OUT, render_examples

BROKEN = Path(__file__).resolve().parent / "broken_accelerate"
EXPECTED = json.loads((BROKEN / "expected.json").read_text())


def _validate(capsys, path: Path, world_size: int, trainer: Path | None = None) -> tuple[int, list[str]]:
    capsys.readouterr()
    extra = ["--trainer-args", str(trainer)] if trainer and trainer.is_file() else []
    code = main(["validate", str(path), "--world-size", str(world_size), *extra])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_the_corpus_is_complete():
    assert {p.stem for p in BROKEN.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_broken_config_gets_its_own_message(name, capsys):
    expected = EXPECTED[name]
    path = BROKEN / f"{name}.yaml"
    code, lines = _validate(capsys, path, expected["world_size"], BROKEN / f"{name}.trainer_args.json")
    assert code == 2
    assert len(lines) == 1, lines  # one problem, one line, no traceback or library log noise
    assert lines[0].startswith(f"{path}: {expected['key']}: "), lines[0]
    assert expected["says"] in lines[0], lines[0]


def test_messages_are_distinct_across_the_corpus(capsys):
    messages = {_validate(capsys, BROKEN / f"{name}.yaml", e["world_size"],
                          BROKEN / f"{name}.trainer_args.json")[1][0].split(": ", 1)[1] for name, e in EXPECTED.items()}
    assert len(messages) == len(EXPECTED)


def test_generated_files_pass_and_json_reports(fsdp_generated, capsys):
    code, lines = _validate(capsys, fsdp_generated / "accelerate.yaml", 2, fsdp_generated / "trainer_args.json")
    assert code == 0 and lines == []
    capsys.readouterr()
    assert main(["validate", str(fsdp_generated / "accelerate.yaml"), "--world-size", "3", "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and [p["key"] for p in report["problems"]] == ["num_processes"]


def test_committed_examples_have_not_drifted():
    rendered = render_examples()
    assert {p.name for p in OUT.iterdir()} == set(rendered)
    for name, text in rendered.items():
        assert (OUT / name).read_text() == text, f"{name} drifted: run python -m toolkit.generate.fsdp_examples"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_committed_examples_pass_the_validator(name, capsys):
    import yaml

    config = OUT / f"{name}.accelerate.yaml"
    world = yaml.safe_load(config.read_text())["num_processes"]
    assert _validate(capsys, config, world, OUT / f"{name}.trainer_args.json") == (0, [])
