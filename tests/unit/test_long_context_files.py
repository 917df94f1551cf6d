"""Long-context plans without a launch: DeepSpeed's tiled MLP and tiled loss (as train.py applies them) give the
untiled loss and gradients on CPU, and `dmt generate` writes Ulysses' and torch context parallel's ParallelismConfig
that Accelerate's own class accepts, which `dmt validate` checks with it."""

import json

import pytest
import torch
import yaml

from helpers import TINY, tiny_llama_config
from toolkit.backends import long_context
from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.estimate.long_context import loss_tile_count, sequence_tiles
from toolkit.generate.parallelism import from_yaml_section, parallelism_config

# a few tokens' fp32 logits a tile, so the tiny batch's loss really runs in several tiles
SMALL_TILES = 4 * 300 * 8
TINY_FSDP = TINY.parent / "tiny-llama-fsdp-cpu.yaml"


def _model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**tiny_llama_config(hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def _loss_and_grads(model, batch, **kwargs):
    model.zero_grad()
    loss = model(**batch, **kwargs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (2, 160))
    labels = ids.clone()
    labels[0, :17] = -100  # a prompt without loss, as SFT rows have
    return {"input_ids": ids, "labels": labels}


def test_sequence_tiles_follow_deepspeeds_rule():
    assert sequence_tiles(160, 32) == 5 and sequence_tiles(161, 32) == 6
    assert sequence_tiles(8, 4096) == 1
    assert loss_tile_count(100, 300, tile_bytes=4 * 300 * 10) == 10  # tiles of 10 tokens' fp32 logits


@pytest.mark.parametrize("tiling", ["mlp", "loss", "both"])
def test_tiled_mlp_and_loss_equal_the_untiled_model(batch, tiling):
    reference, tiled = _model(), _model()
    expected_loss, expected_grads = _loss_and_grads(reference, batch)
    if tiling in ("mlp", "both"):
        assert long_context.tile_mlps(tiled) == 2
    if tiling in ("loss", "both"):
        long_context.tile_loss(tiled, tile_bytes=SMALL_TILES)
    loss, grads = _loss_and_grads(tiled, batch)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_tiled_loss_divides_by_the_trainers_item_count(batch):
    """With gradient accumulation the Trainer passes num_items_in_batch; the loss is then sum / items, as HF's."""
    reference, tiled = _model(), _model()
    long_context.tile_loss(tiled, tile_bytes=SMALL_TILES)
    items = torch.tensor(500)
    expected, expected_grads = _loss_and_grads(reference, batch, num_items_in_batch=items)
    loss, grads = _loss_and_grads(tiled, batch, num_items_in_batch=items)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads["lm_head.weight"], expected_grads["lm_head.weight"], rtol=1e-5, atol=1e-7)


def test_ulysses_gradient_keeps_the_loss_and_divides_its_gradient():
    value = torch.tensor(3.0, requires_grad=True)
    loss = long_context.ulysses_gradient(value * 2, 4)
    loss.backward()
    assert loss.item() == 6.0 and value.grad.item() == 0.5


def _generate(recipe, out, *flags):
    assert main(["generate", str(recipe), "--out", str(out), *flags]) == 0
    return (yaml.safe_load((out / "accelerate.yaml").read_text()), json.loads((out / "trainer_args.json").read_text()),
            json.loads((out / "plan.json").read_text())["plan"])


def test_ulysses_plan_states_accelerates_sequence_parallel_config(tmp_path):
    accelerate, trainer, plan = _generate(TINY, tmp_path, "--sp", "2", "--tiled-mlp", "--tiled-loss",
                                          "--recompute", "full", "--offload-activations", "cpu")
    assert plan["sp"] == 2 and plan["dp"] == 1 and plan["tiled_mlp"] and plan["offload_activations"] == "cpu"
    config = parallelism_config(from_yaml_section(accelerate["parallelism_config"]))
    assert config.sp_enabled and config.sp_backend == "deepspeed" and config.sp_size == 2
    assert config.sp_handler.sp_attn_implementation == "sdpa" and config.data_parallel_size == plan["dp"]
    assert config.total_size == accelerate["num_processes"] == 2
    assert from_yaml_section(accelerate["parallelism_config"]) == trainer["parallelism_config"]
    deepspeed = json.loads((tmp_path / "deepspeed.json").read_text())
    # HF checks train_batch_size against every rank; Accelerate sets micro x accumulation x dp before initialize
    assert deepspeed["sequence_parallel_size"] == 2 and deepspeed["train_batch_size"] == "auto"
    for name in ("accelerate.yaml", "deepspeed.json"):
        assert main(["validate", str(tmp_path / name), "--world-size", "2", "--trainer-args",
                     str(tmp_path / "trainer_args.json")]) == 0


def test_context_parallel_plan_states_torch_context_parallel(tmp_path):
    accelerate, trainer, plan = _generate(TINY_FSDP, tmp_path, "--cp", "2")
    config = parallelism_config(trainer["parallelism_config"])
    assert config.cp_enabled and config.cp_backend == "torch" and config.cp_handler.cp_comm_strategy == "allgather"
    assert config.total_size == plan["gpus"] == 2 and plan["dp"] == 1
    assert from_yaml_section(accelerate["parallelism_config"]) == trainer["parallelism_config"]
    assert main(["validate", str(tmp_path / "accelerate.yaml"), "--world-size", "2", "--trainer-args",
                 str(tmp_path / "trainer_args.json")]) == 0


@pytest.mark.parametrize("edit, says", [
    ({"parallelism_config_sp_attn_implementation": "eager"}, "'eager' and 'flex_attention' are not supported"),
    ({"parallelism_config_sp_size": 4}, "x sp = 1 x 1 x 1 x 1 x 4 = 4, the world size is 2"),
    ({"parallelism_config_cp_size": 2}, "torch context parallel runs under FSDP2 only"),
])
def test_validate_refuses_what_accelerate_refuses(tmp_path, capsys, edit, says):
    _generate(TINY, tmp_path, "--sp", "2")
    path = tmp_path / "accelerate.yaml"
    config = yaml.safe_load(path.read_text())
    config["parallelism_config"].update(edit)
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(["validate", str(path), "--world-size", "2"]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("recipe, flag, says", [
    (TINY, "--cp", "with deepspeed use --sp (Ulysses)"),
    (TINY_FSDP, "--sp", "with fsdp use --cp (torch context parallel)"),
])
def test_each_backend_refuses_the_others_sequence_split(tmp_path, capsys, recipe, flag, says):
    assert main(["generate", str(recipe), "--out", str(tmp_path), flag, "2"]) == 2
    assert says in capsys.readouterr().err


def test_a_mismatched_trainer_parallelism_config_is_refused_when_training_reads_it(tmp_path):
    from toolkit.validate.generated import read_generated

    _generate(TINY, tmp_path, "--sp", "2")
    args = json.loads((tmp_path / "trainer_args.json").read_text())
    args["parallelism_config"]["sp_size"] = 1
    (tmp_path / "trainer_args.json").write_text(json.dumps(args))
    with pytest.raises(UserInputError, match="trainer_args.parallelism_config"):
        read_generated(tmp_path / "plan.json")


def test_heads_that_sp_does_not_divide_are_refused_before_training(tmp_path, capsys):
    """The tiny model has 4 heads and 2 KV heads: sp=4 divides the heads and is a multiple of the KV heads (DeepSpeed
    replicates them) and is read back for training; sp=8 divides no heads: `dmt generate` refuses it in one line
    (DeepSpeed's UlyssesSPAttentionHF would refuse it only once the model is built)."""
    from toolkit.validate.generated import read_generated

    for sp in (4, 8):
        recipe = yaml.safe_load(TINY.read_text())
        recipe["data"]["train_files"] = [str(TINY.parent / name) for name in recipe["data"]["train_files"]]
        recipe["cluster"].update(gpus=sp, gpus_per_node=sp)
        (tmp_path / f"sp{sp}.yaml").write_text(yaml.safe_dump(recipe))
    _generate(tmp_path / "sp4.yaml", tmp_path / "sp4", "--sp", "4")
    assert read_generated(tmp_path / "sp4" / "plan.json").plan.sp == 4
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "sp8.yaml"), "--out", str(tmp_path / "sp8"), "--sp", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sp" in err[0] and "must divide the attention heads (4)" in err[0]
    assert not (tmp_path / "sp8").exists()
