"""hf-to-megatron and megatron-to-hf stream: on a model thirty times the size of its largest tensor, the most bytes of
materialised tensors held at once stays within twice that tensor, in both directions, and the round
trip is still exact. A truncated checkpoint file is one line naming the file, exit 2."""

import json
import shutil
import subprocess

import pytest
from megatron_helpers import BIN

DEEP_NARROW = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=24,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
                   tie_word_embeddings=False)


@pytest.fixture(scope="module")
def deep_narrow(tmp_path_factory):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = tmp_path_factory.mktemp("streaming") / "hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**DEEP_NARROW)).save_pretrained(hf_dir)
    return hf_dir


def test_conversions_hold_one_tensor_at_a_time(deep_narrow, tmp_path):
    import torch
    from safetensors.torch import load_file

    from toolkit.backends.megatron.convert import hf_to_megatron, megatron_to_hf
    from toolkit.checkpoint.dcp import LiveBytes

    original = load_file(deep_narrow / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in original.values())
    largest = 384 * 64 * 4  # the embedding padded to 384 rows, fp32: the largest tensor on either side

    to_megatron, to_hf = LiveBytes(), LiveBytes()
    hf_to_megatron(deep_narrow, tmp_path / "mcore", live=to_megatron)
    megatron_to_hf(tmp_path / "mcore", tmp_path / "back", live=to_hf)

    assert model_bytes > 30 * largest
    assert 0 < to_megatron.peak <= 2 * largest, (to_megatron.peak, largest)
    assert 0 < to_hf.peak <= 2 * largest, (to_hf.peak, largest)
    assert to_megatron.live == to_hf.live == 0
    returned = load_file(tmp_path / "back" / "model.safetensors")
    assert returned.keys() == original.keys()
    assert all(torch.equal(returned[k].view(torch.uint8), original[k].view(torch.uint8)) for k in original)


def test_a_truncated_checkpoint_file_is_one_line_naming_it(deep_narrow, tmp_path):
    from toolkit.backends.megatron.convert import hf_to_megatron

    ckpt = tmp_path / "mcore"
    hf_to_megatron(deep_narrow, ckpt)
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    data = broken / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    result = subprocess.run([str(BIN / "dmt"), "convert", "megatron-to-hf", str(broken), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.startswith("dmt convert: error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "MEGATRON_DIR" in lines[0] and "__0_0.distcp" in lines[0] and "truncated" in lines[0], lines[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
