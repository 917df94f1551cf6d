"""`dmt convert fsdp-to-hf` for every MoE family's tiny model (helpers.TINY_MOE: Qwen3-MoE, Mixtral, DeepSeek-V3,
GPT-OSS), in-process: the model's state dict saved as Accelerate saves FSDP2's SHARDED_STATE_DICT ({"model": ...}
through torch DCP in checkpoint-N/pytorch_model_fsdp_0/, with its config.json beside it) converts to the same tensors,
bit for bit, under the names transformers loads, fused and biased experts, MLA's projections and routing biases
included, as Accelerate's merge_fsdp_weights gives them. One writer holds each tensor whole here; tests/fsdp/test_fsdp_convert.py converts a 2-rank Mixtral run's
shards against Accelerate's merge_fsdp_weights."""

import json
import warnings

import pytest
import torch

from helpers import TINY_MOE, safetensors_tensors
from toolkit.cli.main import main


@pytest.mark.parametrize("family", sorted(TINY_MOE))
def test_every_moe_familys_fsdp_checkpoint_converts_to_the_bit(family, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY_MOE[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    ckpt = tmp_path / "checkpoint-2"
    with warnings.catch_warnings():  # one process saves: DCP's "assuming a single process" is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": state}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"), no_dist=True)
    (ckpt / "config.json").write_text(json.dumps(config.to_dict()))
    capsys.readouterr()
    assert main(["convert", "fsdp-to-hf", str(ckpt), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    ours = safetensors_tensors(tmp_path / "hf")
    tied = {name for name in state if name not in ours}  # tied weights are written once, as save_pretrained does
    assert tied <= {"lm_head.weight"} and all(".experts." not in name for name in tied), tied
    assert any(".experts." in name for name in ours), sorted(ours)
    for name, tensor in ours.items():
        assert tensor.dtype == state[name].dtype and tensor.numpy().tobytes() == state[name].numpy().tobytes(), name
    from accelerate.utils import merge_fsdp_weights

    merge_fsdp_weights(str(ckpt / "pytorch_model_fsdp_0"), str(tmp_path / "merged"), safe_serialization=True)
    theirs = safetensors_tensors(tmp_path / "merged")  # Accelerate's own tool: the same names and bytes
    assert sorted(theirs) == sorted(ours) and all(
        theirs[name].numpy().tobytes() == ours[name].numpy().tobytes() for name in ours), family
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[name], state[name]) for name in state), family
