"""One declaration of the plan options (toolkit.spec.options.PlanOptions): every command's flags, the recipe's plan
section and the rules of a Plan built from a dict all follow from it."""

import argparse
import importlib

import pytest

from toolkit.errors import UserInputError
from toolkit.spec.model import load_model_spec
from toolkit.spec.options import OPTION_NAMES, PlanOptions, choices, flag, recipe_key
from toolkit.spec.plan import Plan, resolve_plan, validated

LLAMA_8B = load_model_spec("llama-3.1-8b")


def _parser(module: str) -> argparse.ArgumentParser:
    if module == "toolkit.train":
        return importlib.import_module(module).build_parser()
    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    return parser


@pytest.mark.parametrize("module", ["toolkit.cli.estimate", "toolkit.cli.plan", "toolkit.cli.generate",
                                    "toolkit.cli.restore", "toolkit.train"])
def test_every_plan_option_is_a_flag_of_every_command_that_takes_a_plan(module):
    actions = {a.dest: a for a in _parser(module)._actions}
    for name in OPTION_NAMES:
        action = actions[name]
        assert flag(name) in action.option_strings and action.default is None
        assert PlanOptions.model_fields[name].description in action.help
        try:
            values = choices(name)
        except KeyError:
            continue
        if action.choices is not None:
            assert list(action.choices) == list(values)


def test_every_plan_option_has_its_recipe_key():
    from toolkit.spec.recipe import Recipe
    from toolkit.spec.recipe_cluster import PlanSection

    for name in OPTION_NAMES:
        section, field = recipe_key(name).split(".")
        model = PlanSection if section == "plan" else Recipe.model_fields[section].annotation
        assert field in model.model_fields, recipe_key(name)
    assert set(PlanSection.model_fields) - {"auto"} == {n for n in OPTION_NAMES if recipe_key(n) == f"plan.{n}"}


def test_a_plan_built_from_a_dict_is_checked_by_the_same_rules():
    plan = resolve_plan(LLAMA_8B, 8, zero=2, offload_optimizer="cpu").as_dict()
    assert validated(Plan, plan) == resolve_plan(LLAMA_8B, 8, zero=2, offload_optimizer="cpu")
    with pytest.raises(UserInputError) as err:  # the rule between options, without any model
        validated(Plan, {**plan, "zero": 0})
    assert err.value.key == "--offload-optimizer" and "needs --zero 1, 2 or 3" in err.value.message
    with pytest.raises(UserInputError) as err:  # derived sizes must agree
        validated(Plan, {**plan, "grad_accum": 2})
    assert err.value.key == "grad_accum"
    with pytest.raises(UserInputError) as err:  # the model's rules, with the model in the context
        validated(Plan, {**plan, "backend": "megatron", "zero": 0, "offload_optimizer": "none", "tp": 3, "dp": 1,
                         "gpus": 3, "transformer_impl": "transformer_engine"}, context={"model": LLAMA_8B})
    assert err.value.key == "--tp"


@pytest.mark.parametrize("options, key, message", [
    (dict(tp=0), "--tp", "must be a positive integer, got 0"),
    (dict(micro_batch=True), "--micro-batch", "must be an integer, got True"),
    (dict(precision="fp64"), "--precision", "got 'fp64'; valid: bf16, fp16, fp32, fp8, fp4"),
    (dict(recompute="selective", recompute_modules="core_attn,attention", backend="megatron"), "--recompute-modules",
     "got 'attention'; valid: core_attn, mlp, moe_act, moe, layernorm, mla_up_proj, shared_experts"),
    (dict(sequence_parallel="yes"), "--sequence-parallel", "must be true or false, got 'yes'"),
])
def test_a_bad_value_names_its_flag_and_what_is_valid(options, key, message):
    with pytest.raises(UserInputError) as err:
        resolve_plan(LLAMA_8B, 8, **options)
    assert (err.value.key, err.value.message) == (key, message)


def test_the_validators_take_their_choices_from_the_declaration():
    from toolkit.validate.megatron import LAYER_SPECS

    assert set(LAYER_SPECS) == set(choices("transformer_impl"))
