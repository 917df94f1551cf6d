"""What the first real GPU launches (benchmarks/gpu_check.md) showed must hold on other library versions and images:
older transformers 5.x names and attributes, a zero warm-up, Megatron-Core without Transformer Engine, peak GPU memory in metrics."""

import json

import pytest

from helpers import ROOT, TINY
from toolkit.planner.recipe import recipe_plan
from toolkit.spec.recipe import load_recipe, recipe_model

TINY_MEGATRON = ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml"


def _with(recipe, **sections):
    return recipe.model_copy(update={name: getattr(recipe, name).model_copy(update=values)
                                     for name, values in sections.items()})


def test_zero_warmup_reaches_hf_and_deepspeed_as_the_same_count():
    from toolkit.generate.deepspeed import deepspeed_config
    from toolkit.generate.trainer_args import trainer_arguments

    recipe = _with(load_recipe(TINY), training={"warmup_steps": 0})
    plan = recipe_plan(recipe, recipe_model(recipe))
    hf = trainer_arguments(recipe, plan, "out", None)
    ds = deepspeed_config(plan, recipe.training)
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 1
    assert hf["warmup_steps"] == 1  # transformers 5.17 refuses ds 1 vs hf 0 at deepspeed_init


def test_activation_checkpointing_takes_the_installed_transformers_name(monkeypatch):
    from transformers import TrainingArguments

    from toolkit.backends.hf_inputs import installed_field_names

    args = {"activation_checkpointing": True, "bf16": True}
    assert installed_field_names(args) == args  # this venv's transformers knows the new name
    older = {k: v for k, v in TrainingArguments.__dataclass_fields__.items() if k != "activation_checkpointing"}
    monkeypatch.setattr(TrainingArguments, "__dataclass_fields__", older)
    assert installed_field_names(args) == {"gradient_checkpointing": True, "bf16": True}
    assert args == {"activation_checkpointing": True, "bf16": True}  # the caller's dict is left as it was


@pytest.mark.parametrize("impl, expected", [(None, "transformer_engine"), ("local", "local"),
                                            ("transformer_engine", "transformer_engine")])
def test_megatron_layer_modules_on_gpus_follow_the_recipe(impl, expected):
    from toolkit.backends.megatron.training import megatron_yaml_for

    recipe = _with(load_recipe(TINY_MEGATRON), cluster={"accelerator": "gpu"}, plan={"transformer_impl": impl})
    model = recipe_model(recipe)
    config = megatron_yaml_for(recipe, model, recipe_plan(recipe, model))
    assert config["transformer_config"]["transformer_impl"] == expected


def test_an_unknown_transformer_impl_names_the_recipe_key(tmp_path):
    from toolkit.errors import UserInputError

    text = TINY_MEGATRON.read_text().replace("\nplan:\n", "\nplan:\n  transformer_impl: apex\n")
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace("data/", str(ROOT / "recipes" / "data") + "/"))
    with pytest.raises(UserInputError) as err:
        load_recipe(path)
    assert "plan.transformer_impl" in str(err.value) and "got 'apex'" in str(err.value)


def test_metrics_carry_gpu_memory_only_where_cuda_runs(tmp_path):
    """Without CUDA (the CI machine) no GPU keys; with it, this rank's peak allocator figures after real work."""
    import torch

    from toolkit.runtime.metrics import MetricsWriter, gpu_memory

    if torch.cuda.is_available():
        block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB on the device
        del block
    MetricsWriter(tmp_path, 128).write(1, 2.0, 0.5, 1e-3)
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["step"] == 1
    if torch.cuda.is_available():
        assert record["gpu_max_allocated_bytes"] >= 64 * 2**20
        assert record["gpu_max_reserved_bytes"] >= record["gpu_max_allocated_bytes"]
    else:
        assert gpu_memory() == {} and "gpu_max_allocated_bytes" not in record


def test_logged_loss_share_on_transformers_without_the_scaling_override():
    """transformers 5.17 (the GPU image's) has no `Trainer.loss_is_scaled_for_ga` (the FSDP2 run of
    benchmarks/checkpoint_stall.py --gpu stopped at its first step on it); its test alone decides, as HF's does."""
    from types import SimpleNamespace

    from transformers import Trainer

    from toolkit.compat.transformers_seams import loss_as_logged

    assert hasattr(Trainer, "loss_is_scaled_for_ga")  # this venv's transformers has the override
    old = dict(model_accepts_loss_kwargs=True, compute_loss_func=None, current_gradient_accumulation_steps=4)
    assert loss_as_logged(SimpleNamespace(**old), 8.0, num_items_in_batch=100) == 8.0  # normalized by the model
    assert loss_as_logged(SimpleNamespace(**old), 8.0, num_items_in_batch=None) == 2.0
    assert loss_as_logged(SimpleNamespace(**old, loss_is_scaled_for_ga=False), 8.0, num_items_in_batch=100) == 2.0
