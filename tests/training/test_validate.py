"""`dmt validate`: a corpus of broken DeepSpeed configs, each with its own clear message; trainer arguments that
disagree with the JSON, every mismatch listed at once; the memory fit; "auto" values; exit codes and --json."""

import json
from pathlib import Path

import pytest

from helpers import TINY
from toolkit.cli.main import main
from toolkit.validate.deepspeed import validate_deepspeed_config

BROKEN = Path(__file__).resolve().parent / "broken_configs"
EXPECTED = json.loads((BROKEN / "expected.json").read_text())


def _validate(capsys, *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["validate", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_the_corpus_is_complete():
    assert {p.stem for p in BROKEN.glob("*.json")} - {"expected"} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_broken_config_gets_its_own_message(name, capsys):
    expected = EXPECTED[name]
    path = BROKEN / f"{name}.json"
    code, lines = _validate(capsys, str(path), "--world-size", str(expected["world_size"]))
    assert code == 2
    assert len(lines) == 1, lines  # one problem, one line, no traceback or library log noise
    assert lines[0].startswith(f"{path}: {expected['key']}: "), lines[0]
    assert expected["says"] in lines[0], lines[0]


def test_messages_are_distinct_across_the_corpus(capsys):
    messages = set()
    for name, expected in EXPECTED.items():
        _, lines = _validate(capsys, str(BROKEN / f"{name}.json"), "--world-size", str(expected["world_size"]))
        messages.add(lines[-1].split(": ", 1)[1])
    assert len(messages) == len(EXPECTED)


def test_the_same_config_is_fine_at_the_world_size_it_was_written_for(capsys):
    # batch_mismatch says 24 = 4 x 2 x dp: wrong at 2 ranks, right at 3
    assert _validate(capsys, str(BROKEN / "batch_mismatch.json"), "--world-size", "3")[0] == 0


def test_a_minimal_hand_written_config_passes(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}))
    code, lines = _validate(capsys, str(path), "--world-size", "4")
    assert code == 0 and lines == []


def test_pipeline_stages_are_refused_as_every_deepspeed_plan_refuses_them(tmp_path, capsys):
    from toolkit.backends.deepspeed.rules import check_pipeline as check_deepspeed_pipeline
    from toolkit.errors import UserInputError

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}))
    with pytest.raises(UserInputError) as rule:
        check_deepspeed_pipeline(2)
    code, lines = _validate(capsys, str(path), "--world-size", "4", "--pp", "2")
    assert code == 2 and lines == [f"dmt validate: error: {rule.value}"]
    assert "--backend megatron for pipeline parallelism" in lines[0]
    assert _validate(capsys, str(path), "--world-size", "4", "--pp", "1") == (0, [])
    assert main(["validate", "--help"]) == 0 and "--pp" not in capsys.readouterr().out  # no longer offered


def test_a_config_with_only_train_batch_size_is_checked_like_deepspeed_derives_it(tmp_path, capsys):
    """DeepSpeed accepts train_batch_size alone (micro = train / (accumulation x dp)): valid where that divides."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "gradient_accumulation_steps": 2}))
    assert _validate(capsys, str(path), "--world-size", "4") == (0, [])
    code, lines = _validate(capsys, str(path), "--world-size", "3")
    assert code == 2 and lines == [f"{path}: train_batch_size: 16 is not divisible by accumulation 2 x dp 3 at world "
                                   f"size 3; set train_batch_size to a multiple of 6"]
    path.write_text("{}")
    code, lines = _validate(capsys, str(path), "--world-size", "2")
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"{path}: train_micro_batch_size_per_gpu: neither it nor train_batch_size is set")


def test_memory_fit_uses_the_micro_batch_deepspeed_derives():
    from toolkit.spec.cluster import get_gpu
    from toolkit.spec.model import load_model_spec
    from toolkit.validate.deepspeed import memory_problem

    model, gpu = load_model_spec("llama-3.1-8b"), get_gpu("h100-80gb")
    layout = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    derived = memory_problem({**layout, "train_batch_size": 16}, model, gpu, 2, 4096, "none")
    explicit = memory_problem({**layout, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8}, model, gpu, 2,
                              4096, "none")
    assert derived is not None and derived == explicit


@pytest.fixture
def tiny_files(tmp_path):
    out = tmp_path / "gen"
    assert main(["generate", str(TINY), "--out", str(out)]) == 0
    return out


def test_every_trainer_args_mismatch_is_listed_at_once(tiny_files, capsys):
    trainer = json.loads((tiny_files / "trainer_args.json").read_text())
    trainer.update(learning_rate=1.0, per_device_train_batch_size=8, max_steps=99, optim="sgd",
                   lr_scheduler_type="linear", max_grad_normm=2.0, deepspeed="/elsewhere/ds.json")
    (tiny_files / "trainer_args.json").write_text(json.dumps(trainer))
    code, lines = _validate(capsys, str(tiny_files / "deepspeed.json"), "--world-size", "2",
                            "--trainer-args", str(tiny_files / "trainer_args.json"))
    assert code == 2
    keys = [line.split(": ")[1] for line in lines]
    assert sorted(keys) == sorted(["optimizer.params.lr", "train_micro_batch_size_per_gpu",
                                   "scheduler.params.total_num_steps", "optimizer.type", "scheduler.type",
                                   "trainer_args.max_grad_normm", "trainer_args.deepspeed"]), lines
    text = "\n".join(lines)
    assert "0.005 in the DeepSpeed JSON but learning_rate gives 1.0" in text
    assert "did you mean 'max_grad_norm'?" in text
    assert "use lr_scheduler_type cosine or cosine_with_min_lr" in text


def test_trainer_args_that_agree_pass(tiny_files, capsys):
    code, lines = _validate(capsys, str(tiny_files / "deepspeed.json"), "--world-size", "2",
                            "--trainer-args", str(tiny_files / "trainer_args.json"))
    assert code == 0, lines


def test_auto_values_are_filled_from_the_trainer_arguments_like_hf_does(tiny_files):
    config = json.loads((tiny_files / "deepspeed.json").read_text())
    trainer = json.loads((tiny_files / "trainer_args.json").read_text())
    config.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    assert validate_deepspeed_config(config, 2, trainer_args=trainer) == []
    # HF fills micro 4 x accumulation 2 x dp 2 = 16; a global batch that is wrong for the world size still shows up
    config["train_batch_size"] = 24
    problems = validate_deepspeed_config(config, 2, trainer_args=trainer)
    assert [p.key for p in problems] == ["train_batch_size"]
    assert "24 in the DeepSpeed JSON but per_device_train_batch_size x gradient_accumulation_steps x dp gives 16" \
        in problems[0].message


def test_memory_fit_names_the_numbers_and_the_fix(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                                "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 0}}))
    code = main(["validate", str(path), "--world-size", "8", "--model", "llama-3.1-70b", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 2 and not report["ok"] and [p["key"] for p in report["problems"]] == ["memory"]
    message = report["problems"][0]["message"]
    assert "GiB per GPU estimated for llama-3.1-70b" in message and "raise the ZeRO stage" in message
    # the same layout with ZeRO-3 and CPU offload of everything fits
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                                "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                      "offload_optimizer": {"device": "cpu"}}}))
    assert main(["validate", str(path), "--world-size", "8", "--model", "llama-3.1-70b", "--recompute", "full",
                 "--json"]) == 0, capsys.readouterr().out


def test_unreadable_input_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text("{not json")
    code, lines = _validate(capsys, str(path), "--world-size", "2")
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"dmt validate: error: FILE: {path} is not valid JSON")
    code, lines = _validate(capsys, str(BROKEN / "batch_mismatch.json"), "--world-size", "0")
    assert code == 2 and lines == ["dmt validate: error: --world-size: must be positive, got 0"]
