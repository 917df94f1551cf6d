"""Numbers that are not numbers: NaN, inf, -inf and 1e999 (a float's inf) given as a flag, a recipe value, a number in
a DeepSpeed JSON, a megatron.yaml, trainer arguments, a health report, a calibration or an adapter config. Each is
refused with exit code 2 and one line naming the flag or key, nothing is written, and no --json output or generated
file ever holds NaN or Infinity."""

import argparse
import json
import math

import pytest
import yaml
from test_calibration import _calibration_file
from test_fuzz_verbs import (  # noqa: F401 (sandbox: a fixture)
    RECIPE_TEXT,
    _assert_refused,
    _run,
    _snapshot,
    refuses_recipe_edit,
    sandbox,
)

from toolkit.cli.main import VERBS, build_parser, main
from toolkit.numeric import COUNT_MAX, FLOAT_FLAGS, INT_FLAGS, SEED_MAX, FloatRange, json_text, non_finite

NOT_NUMBERS = ("nan", "inf", "-inf", "1e999", "NaN", "-Infinity")


def _number_flags(types: tuple) -> list[tuple[tuple[str, ...], str, object]]:
    """Every flag of every verb (and sub-verb) whose value is of one of these types: (the verb's argv, the flag, its
    type), read from the parsers themselves, so a flag added later is covered here without a new line."""
    found = []

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
            elif action.option_strings and action.type in types and action.choices is None:  # choices bound it
                found.append((path, action.option_strings[0], action.type))

    for verb in VERBS:
        top = build_parser(verb)
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
        walk(sub.choices[verb], (verb,))
    return found


FLOAT_FLAG_LIST = _number_flags((float, *FLOAT_FLAGS))
INT_FLAG_LIST = _number_flags((int, *INT_FLAGS))


def test_the_walk_finds_the_float_flags_of_every_kind_of_verb():
    flags = {(path, flag) for path, flag, _ in FLOAT_FLAG_LIST}
    assert {(("estimate",), "--inter-node-bw"), (("plan",), "--lora-alpha"), (("restore-test",), "--tolerance"),
            (("health",), "--deadline-s"), (("convert", "check"), "--tolerance")} <= flags, sorted(flags)


@pytest.mark.parametrize("path, flag, kind", FLOAT_FLAG_LIST, ids=[f"{' '.join(p)} {f}" for p, f, _ in FLOAT_FLAG_LIST])
def test_every_float_flag_takes_the_finite_type(path, flag, kind):
    assert kind in FLOAT_FLAGS, f"dmt {' '.join(path)} {flag} is a plain float: give it type=finite_float"


@pytest.mark.parametrize("value", NOT_NUMBERS)
@pytest.mark.parametrize("path, flag", [(p, f) for p, f, _ in FLOAT_FLAG_LIST],
                         ids=[f"{' '.join(p)} {f}" for p, f, _ in FLOAT_FLAG_LIST])
def test_a_float_flag_refuses_what_is_not_a_finite_number(capsys, path, flag, value):
    code, err = _run(capsys, [*path, f"{flag}={value}"])
    _assert_refused(code, err, flag, "finite")


def test_the_walk_finds_the_integer_flags(capsys):
    flags = {(path, flag) for path, flag, _ in INT_FLAG_LIST}
    assert {(("estimate",), "--gpus"), (("plan",), "--top"), (("validate",), "--world-size"),
            (("slurm", "render"), "--nodes"), (("estimate",), "--lora-r")} <= flags, sorted(flags)


@pytest.mark.parametrize("path, flag, kind", INT_FLAG_LIST, ids=[f"{' '.join(p)} {f}" for p, f, _ in INT_FLAG_LIST])
def test_every_integer_flag_is_bounded(capsys, path, flag, kind):
    """A 300-digit integer overflows the float arithmetic of the estimates (an OverflowError traceback): refused at
    the flag, as is one just past 2**53, where floats stop holding integers exactly."""
    assert kind in INT_FLAGS, f"dmt {' '.join(path)} {flag} is a plain int: give it type=bounded_int"
    for value in ("1" + "0" * 300, str(COUNT_MAX + 1), str(-COUNT_MAX - 1)):
        code, err = _run(capsys, [*path, f"{flag}={value}"])
        _assert_refused(code, err, flag, "at most")


@pytest.mark.parametrize("value", ["0", "-5"])
@pytest.mark.parametrize("flag", ["--intra-node-bw", "--inter-node-bw"])
def test_a_bandwidth_must_be_positive(capsys, flag, value):
    code, err = _run(capsys, ["estimate", "--model", "llama-3.1-8b", "--gpus", "8", f"{flag}={value}"])
    _assert_refused(code, err, flag, "positive")


RECIPE_NUMBERS = {  # a recipe line replaced -> the key the error must name
    "learning_rate .inf": ("learning_rate: 0.005", "learning_rate: .inf", "training.learning_rate"),
    "learning_rate .nan": ("learning_rate: 0.005", "learning_rate: .nan", "training.learning_rate"),
    "learning_rate 1e999": ("learning_rate: 0.005", "learning_rate: 1.0e+999", "training.learning_rate"),
    "weight_decay .inf": ("weight_decay: 0.0", "weight_decay: .inf", "training.weight_decay"),
    "grad_clip -.inf": ("grad_clip: 1.0", "grad_clip: -.inf", "training.grad_clip"),
    "hang_timeout_s .inf": ("seed: 7", "seed: 7\n  hang_timeout_s: .inf", "training.hang_timeout_s"),
    "eval_fraction .nan": ("eval_fraction: 0.05", "eval_fraction: .nan", "data.eval_fraction"),
    "lora alpha .nan": ("plan:", "finetune:\n  method: lora\n  alpha: .nan\nplan:", "finetune.alpha"),
    "lora dropout .nan": ("plan:", "finetune:\n  method: lora\n  dropout: .nan\nplan:", "finetune.dropout"),
    "seed 2**70": ("seed: 7", f"seed: {2**70}", "training.seed"),
    "seed -1": ("seed: 7", "seed: -1", "training.seed"),
    "seed 2**32": ("seed: 7", f"seed: {SEED_MAX + 1}", "training.seed"),
}


@pytest.mark.parametrize("case", sorted(RECIPE_NUMBERS))
@pytest.mark.parametrize("verb", ["generate", "slurm render", "restore-test"])
def test_a_recipe_number_that_is_not_one_names_its_key(sandbox, capsys, case, verb):  # noqa: F811
    refuses_recipe_edit(sandbox, capsys, verb, *RECIPE_NUMBERS[case])


def test_the_largest_seed_numpy_takes_is_a_seed(sandbox):  # noqa: F811
    from toolkit.spec.recipe import load_recipe

    recipe = sandbox / "recipe.yaml"
    recipe.write_text(RECIPE_TEXT.replace("seed: 7", f"seed: {SEED_MAX}"))
    assert load_recipe(recipe).training.seed == SEED_MAX


DEEPSPEED_TEXTS = {  # a DeepSpeed JSON as text (Python's json reads NaN, Infinity and 1e999) -> the key at fault
    "lr NaN": ('{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": NaN}}}',
               "optimizer.params.lr"),
    "gradient_clipping NaN": ('{"train_micro_batch_size_per_gpu": 1, "gradient_clipping": NaN}', "gradient_clipping"),
    "gradient_clipping Infinity": ('{"train_micro_batch_size_per_gpu": 1, "gradient_clipping": Infinity}',
                                   "gradient_clipping"),
    "weight_decay -Infinity": ('{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": '
                               '{"lr": 1e-4, "weight_decay": -Infinity}}}', "optimizer.params.weight_decay"),
    "betas 1e999": ('{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": '
                    '{"lr": 1e-4, "betas": [0.9, 1e999]}}}', "optimizer.params.betas[1]"),
    "params_dtype manual_seed": ('{"train_micro_batch_size_per_gpu": 1, "params_dtype": "manual_seed"}',
                                 "params_dtype"),
    "grad_accum_dtype manual_seed": ('{"train_micro_batch_size_per_gpu": 1, "data_types": {"grad_accum_dtype": '
                                     '"manual_seed"}}', "data_types.grad_accum_dtype"),
}


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
@pytest.mark.parametrize("case", sorted(DEEPSPEED_TEXTS))
def test_validate_refuses_a_deepspeed_json_number_that_is_not_one(tmp_path, capsys, case, json_flag):
    text, key = DEEPSPEED_TEXTS[case]
    path = tmp_path / "ds.json"
    path.write_text(text)
    code = main(["validate", str(path), "--world-size", "2", *json_flag])
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and "NaN" not in captured.out and "Infinity" not in captured.out
    if json_flag and captured.out:  # the problems as one JSON object: the key is named there
        problems = json.loads(captured.out)["problems"]
        assert any(p["key"] == key for p in problems), problems
    else:
        _assert_refused(code, err, key)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """A generated DeepSpeed job and a Megatron-Core job of the tiny recipe, for their files to be damaged."""
    root = tmp_path_factory.mktemp("generated")
    for backend in ("deepspeed", "megatron"):
        recipe = root / f"{backend}.yaml"
        recipe.write_text(RECIPE_TEXT.replace("backend: deepspeed\n  zero: 2", f"backend: {backend}"))
        assert main(["generate", str(recipe), "--out", str(root / backend)]) == 0
    return root


MEGATRON_VALUES = {  # (section, key, YAML value) -> the key the error must name
    "params_dtype manual_seed": ("transformer_config", "params_dtype", "manual_seed"),
    "pipeline_dtype Tensor": ("transformer_config", "pipeline_dtype", "Tensor"),
    "lr .nan": ("optimizer_config", "lr", float("nan")),
    "clip_grad .inf": ("optimizer_config", "clip_grad", float("inf")),
    "seed 2**70": ("schedule", "seed", 2**70),
}


@pytest.mark.parametrize("case", sorted(MEGATRON_VALUES))
def test_validate_refuses_a_megatron_yaml_value_that_is_not_one(generated, tmp_path, capsys, case):
    section, key, value = MEGATRON_VALUES[case]
    config = yaml.safe_load((generated / "megatron" / "megatron.yaml").read_text())
    config[section][key] = value
    path = tmp_path / "megatron.yaml"
    path.write_text(yaml.safe_dump(config))
    code, err = _run(capsys, ["validate", str(path), "--world-size", "2"])
    _assert_refused(code, err, f"{section}.{key}")
    assert main(["validate", str(generated / "megatron" / "megatron.yaml"), "--world-size", "2"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("token", ["NaN", "Infinity", "1e999"])
def test_validate_refuses_trainer_arguments_that_are_not_numbers(generated, tmp_path, capsys, token):
    text = (generated / "deepspeed" / "trainer_args.json").read_text()
    args = tmp_path / "trainer_args.json"
    args.write_text(text.replace('"learning_rate": 0.005', f'"learning_rate": {token}'))
    assert args.read_text() != text
    code, err = _run(capsys, ["validate", str(generated / "deepspeed" / "deepspeed.json"), "--world-size", "2",
                              "--trainer-args", str(args)])
    _assert_refused(code, err, "--trainer-args", "learning_rate")


def test_validate_refuses_an_accelerate_yaml_number_that_is_not_one(tmp_path, capsys):
    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_min_num_params: .inf\n")
    code, err = _run(capsys, ["validate", str(path), "--world-size", "2"])
    _assert_refused(code, err, "fsdp_config.fsdp_min_num_params")


HEALTH_READERS = {  # argv with {report} -> the flag that reads a `dmt health --json` report
    "estimate --measured-bw": (["estimate", "--model", "llama-3.1-8b", "--gpus", "16", "--measured-bw", "{report}",
                                "--json"], "--measured-bw"),
    "plan --measured-bw": (["plan", "--model", "llama-3.1-8b", "--gpus", "16", "--seq-len", "512", "--global-batch",
                            "16", "--measured-bw", "{report}", "--json"], "--measured-bw"),
    "calibrate --health": (["calibrate", "{tmp}", "--health", "{report}", "--out", "{tmp}/calibration.yaml",
                            "--json"], "--health"),
}


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("tier", ["intra_node_busbw_gbps", "inter_node_busbw_gbps"])
@pytest.mark.parametrize("reader", sorted(HEALTH_READERS))
def test_a_health_report_bandwidth_that_is_not_a_number_is_refused(tmp_path, capsys, reader, tier, token):
    other = "inter_node_busbw_gbps" if tier == "intra_node_busbw_gbps" else "intra_node_busbw_gbps"
    report = tmp_path / "health.json"
    report.write_text(f'{{"healthy": true, "bandwidth": {{"{tier}": {token}, "{other}": 40.0}}}}')
    before = _snapshot(tmp_path)
    argv_template, flag = HEALTH_READERS[reader]
    code = main([part.format(report=report, tmp=tmp_path) for part in argv_template])
    captured = capsys.readouterr()
    _assert_refused(code, [line for line in captured.err.splitlines() if line.strip()], flag, f"bandwidth.{tier}")
    assert captured.out == "" and _snapshot(tmp_path) == before


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["efficiency.hf.compute_scale", "links.inter_node_busbw_gbps"])
def test_a_calibration_number_that_is_not_one_is_refused(tmp_path, capsys, where, value):
    path = _calibration_file(tmp_path / "cal.yaml", "h100-80gb",
                             links={"intra_node_busbw_gbps": 100.0, "inter_node_busbw_gbps": 40.0, "source": "h.json"})
    data = yaml.safe_load(path.read_text())
    *parents, last = where.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[last] = value
    path.write_text(yaml.safe_dump(data))
    code, err = _run(capsys, ["estimate", "--model", "llama-3.2-1b", "--gpus", "8", "--calibration", str(path),
                              "--json"])
    _assert_refused(code, err, "--calibration", where)


def test_the_spec_models_refuse_non_finite_numbers_themselves():
    """Not only through the readers: a model built from a dict (the explore form, a test, a future reader) refuses
    them too, in a nested float (a calibration's dict of peaks) as in a plain one."""
    from pydantic import BaseModel, ValidationError

    from toolkit.spec import calibration, cluster, finetune, model, options, recipe

    models = {cls for module in (calibration, cluster, finetune, model, options, recipe) for cls in vars(module).values()
              if isinstance(cls, type) and issubclass(cls, BaseModel) and cls.__module__ == module.__name__}
    assert len(models) >= 10 and all(cls.model_config.get("allow_inf_nan") is False for cls in models), \
        sorted(cls.__name__ for cls in models if cls.model_config.get("allow_inf_nan") is not False)
    with pytest.raises(ValidationError, match="finite"):
        finetune.FinetuneOptions(method="lora", alpha=math.inf)
    with pytest.raises(ValidationError, match="finite"):
        calibration.MeasuredLinks(inter_node_busbw_gbps=math.nan, source="x")


def test_json_output_never_holds_nan_or_infinity():
    assert json.loads(json_text({"a": [1, 2.5, None]})) == {"a": [1, 2.5, None]}
    with pytest.raises(RuntimeError, match=r"runs\[1\]\.mfu"):
        json_text({"runs": [{"mfu": 0.4}, {"mfu": math.nan}]})
    assert non_finite({"a": {"b": [1.0, {"c": -math.inf}]}}) == ("a.b[1].c", -math.inf)
    assert non_finite({"a": [1, 2.0, "nan"]}) is None


@pytest.fixture(scope="module")
def lora_pair(tmp_path_factory):
    """A tiny Llama base and a LoRA adapter of it, saved by transformers and PEFT on CPU (lora_B made non-zero, as
    after training, so that the adapter changes the weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import tiny_llama_config

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**tiny_llama_config()))
    base.save_pretrained(root / "base", safe_serialization=True)
    peft_model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    peft_model.save_pretrained(root / "adapter")
    return root


@pytest.mark.parametrize("alpha", ["NaN", "Infinity", "1e999", "1e308", "true"])
def test_merge_lora_refuses_an_alpha_that_gives_no_model(lora_pair, tmp_path, capsys, alpha):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for file in (lora_pair / "adapter").iterdir():
        (adapter / file.name).write_bytes(file.read_bytes())
    config = adapter / "adapter_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()), indent=2)
                      .replace('"lora_alpha": 4', f'"lora_alpha": {alpha}'))
    assert f'"lora_alpha": {alpha}' in config.read_text()
    code, err = _run(capsys, ["convert", "merge-lora", str(lora_pair / "base"), str(adapter), str(tmp_path / "out")])
    _assert_refused(code, err, "ADAPTER", "lora_alpha" if alpha != "1e308" else "merging")
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_merge_lora_of_a_finite_adapter_writes_finite_weights(lora_pair, tmp_path, capsys):
    from safetensors.torch import load_file

    assert main(["convert", "merge-lora", str(lora_pair / "base"), str(lora_pair / "adapter"),
                 str(tmp_path / "out")]) == 0
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert all(bool(t.isfinite().all()) for t in weights.values())
    capsys.readouterr()


RANGED_FLAGS = [(path, flag, kind) for path, flag, kind in FLOAT_FLAG_LIST if isinstance(kind, FloatRange)]


def test_the_walk_finds_the_flags_of_a_plausible_range():
    assert {flag for _, flag, _ in RANGED_FLAGS} >= {"--failure-rate", "--restart-s", "--checkpoint-write-bw",
                                                     "--checkpoint-write-s", "--gpu-hour-price", "--deadline-s"}


@pytest.mark.parametrize("path, flag, kind", RANGED_FLAGS, ids=[f"{' '.join(p)} {f}" for p, f, _ in RANGED_FLAGS])
def test_a_finite_number_past_a_flags_plausible_range_is_refused(capsys, path, flag, kind):
    """Finite, but huge or tiny: 1e300 overflowed Daly's exponentials (OverflowError) or printed a 300-digit cost
    with exit code 0; 1e-300 a checkpoint written in no time. Each is refused at the flag, naming its range."""
    argv = [*path, "--model", "llama-3.1-8b", "--gpus", "8", "--train-tokens", "1T"] \
        if path in (("estimate",), ("plan",)) else [*path]
    if path == ("plan",):
        argv += ["--seq-len", "512", "--global-batch", "8"]
    for value in ("1e300", "-1e300", repr(kind.high * 10 + 1), "-1" if kind.low == 0 else repr(kind.low / 10)):
        code, err = _run(capsys, [*argv, f"{flag}={value}"])
        _assert_refused(code, err, flag, f"from {kind.low:g} to {kind.high:g}")


def test_failures_faster_than_restarts_are_one_line_not_an_overflow(capsys):
    """Within every flag's range, a run whose restarts take longer than failures come never completes: one line
    naming --failure-rate, not an OverflowError in Daly's formula, nor inf days with exit code 0."""
    code, err = _run(capsys, ["estimate", "--model", "llama-3.1-8b", "--gpus", "16384", "--train-tokens", "1T",
                              "--failure-rate", "1", "--restart-s", "600000"])
    _assert_refused(code, err, "--failure-rate", "never completes")


@pytest.mark.parametrize("text", ["1e300", "9e15T", "99999999999999999999P"])
def test_a_token_budget_past_a_count_is_refused(capsys, text):
    code, err = _run(capsys, ["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--train-tokens", text])
    _assert_refused(code, err, "--train-tokens", "at most")


@pytest.mark.parametrize("where, value", [("efficiency.hf.fixed_step_s", 1e300), ("efficiency.hf.compute_scale", 1e300),
                                          ("efficiency.hf.compute_scale", 1e-300)])
@pytest.mark.parametrize("verb", ["estimate", "plan"])
def test_a_calibration_number_past_any_fit_is_refused(tmp_path, capsys, where, value, verb):
    """Finite, but no fit of a run: a fixed cost of 1e300 s a step overflowed Daly's formula (an OverflowError, or a
    line blaming --failure-rate); a scale of 1e-300 likewise. Refused naming --calibration and the key."""
    path = _calibration_file(tmp_path / "cal.yaml", "h100-80gb", fixed_step_s=0.01)
    data = yaml.safe_load(path.read_text())
    data["efficiency"]["hf"][where.rsplit(".", 1)[1]] = value
    path.write_text(yaml.safe_dump(data))
    argv = [verb, "--model", "llama-3.2-1b", "--gpus", "8", "--calibration", str(path), "--train-tokens", "1T"]
    code, err = _run(capsys, argv + (["--seq-len", "512", "--global-batch", "8"] if verb == "plan" else []))
    _assert_refused(code, err, "--calibration", where)
