"""Validating megatron.yaml: a corpus of broken Megatron settings (tests/megatron/broken_megatron.yaml), each with
its own one-line message naming the key and the fix; the padding note; --json; a good file passes."""

import copy
import json
from pathlib import Path

import pytest
import yaml

from helpers import ROOT
from toolkit.cli.validate_megatron import main

HERE = Path(__file__).resolve().parent
BASE = ROOT / "megatron_configs" / "tiny-llama-megatron-cpu-tp2.yaml"
CORPUS = yaml.safe_load((HERE / "broken_megatron.yaml").read_text())


def broken_file(tmp_path: Path, name: str) -> Path:
    config = copy.deepcopy(yaml.safe_load(BASE.read_text()))
    for dotted, value in CORPUS[name]["set"].items():
        *parents, last = dotted.split(".")
        target = config
        for part in parents:
            target = target[part]
        target[last] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _validate(capsys, *argv: str) -> tuple[int, list[str], str]:
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_each_broken_setting_gets_its_own_message(name, tmp_path, capsys):
    case = CORPUS[name]
    path = broken_file(tmp_path, name)
    code, lines, _ = _validate(capsys, str(path), "--world-size", str(case.get("world_size", 2)))
    assert code == 2
    assert len(lines) == 1, lines  # one problem, one line, no traceback or library noise
    assert lines[0].startswith(f"{path}: {case['key']}: "), lines[0]
    assert case["says"] in lines[0], lines[0]


def test_messages_are_distinct_across_the_corpus(tmp_path, capsys):
    messages = set()
    for name, case in CORPUS.items():
        _, lines, _ = _validate(capsys, str(broken_file(tmp_path, name)), "--world-size", str(case.get("world_size", 2)))
        messages.add(lines[-1].split(": ", 1)[1])
    assert len(messages) == len(CORPUS)


def test_the_generated_file_passes_and_reports_the_vocabulary_padding(tmp_path, capsys):
    code, lines, out = _validate(capsys, str(BASE))
    assert code == 0 and lines == [] and "valid for world size 2" in out and "padded" not in out
    config = yaml.safe_load(BASE.read_text())
    config["model"]["vocab_size"] = 500  # a tokenizer of 500 ids: Megatron pads the embedding to 512
    path = tmp_path / "padded.yaml"
    path.write_text(yaml.safe_dump(config))
    code, _, out = _validate(capsys, str(path), "--json")
    assert code == 0
    assert json.loads(out) == {"ok": True, "problems": [],
                               "notes": ["vocabulary 500 padded to 512 (+12 rows, multiple of 128 x tp 2)"]}


def test_json_lists_the_problem(tmp_path, capsys):
    code, _, out = _validate(capsys, str(broken_file(tmp_path, "micro_batch_zero")), "--json")
    assert code == 2
    assert json.loads(out)["problems"] == [{"key": "schedule.micro_batch_size", "message": "0 is not a positive integer"}]


def test_an_unreadable_file_exits_2_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("transformer_config: [unclosed")
    code, lines, _ = _validate(capsys, str(path))
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"validate: error: FILE: {path} is not valid YAML")
