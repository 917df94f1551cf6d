"""The streaming sharded writer against transformers' own `save_pretrained` on a real tiny Llama: the same files,
the same tensors in each, the same index; a size huggingface_hub cannot read is refused naming the flag."""

import json

import pytest
import torch
from safetensors import safe_open

from helpers import tiny_llama_config
from toolkit.checkpoint.safetensors_stream import ShardedSafetensorsWriter, parse_size
from toolkit.errors import UserInputError


def _files(directory) -> dict[str, dict[str, torch.Tensor]]:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            found[path.name] = {key: handle.get_tensor(key) for key in handle.keys()}
    return found


# 600KB: the 1 MB embedding and each 704 KB MLP matrix lie alone in shards huggingface_hub plans out of layout order,
# the attention matrices share shards; 50MB: one model.safetensors and no index
@pytest.mark.parametrize("size", ["600KB", "50MB"])
def test_streamed_shards_are_what_save_pretrained_writes(tmp_path, size):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_llama_config()))
    model.save_pretrained(tmp_path / "theirs", max_shard_size=size)
    state = model.state_dict()
    ours = tmp_path / "ours"
    ours.mkdir()
    writer = ShardedSafetensorsWriter(ours, [(k, tuple(v.shape), v.dtype) for k, v in state.items()], parse_size(size))
    for name, tensor in state.items():
        writer.write(name, tensor)
    writer.close()

    theirs_files, ours_files = _files(tmp_path / "theirs"), _files(ours)
    assert sorted(ours_files) == sorted(theirs_files)
    assert (len(ours_files) > 4) == (size == "600KB")
    for file, tensors in theirs_files.items():
        assert sorted(ours_files[file]) == sorted(tensors), file
        assert all(torch.equal(ours_files[file][k], v) for k, v in tensors.items()), file
    index = "model.safetensors.index.json"
    assert (ours / index).is_file() == (tmp_path / "theirs" / index).is_file()
    if (ours / index).is_file():
        assert (ours / index).read_text() == (tmp_path / "theirs" / index).read_text()
        assert writer.total == json.loads((ours / index).read_text())["metadata"]["total_size"]


@pytest.mark.parametrize("text", ["2GiB", "5 parsecs", "GB", ""])
def test_a_size_huggingface_hub_cannot_read_is_refused_naming_the_flag(text):
    with pytest.raises(UserInputError) as caught:
        parse_size(text)
    assert caught.value.key == "--max-shard-size" and "\n" not in str(caught.value)


@pytest.mark.parametrize("text", ["1000", "1KB", "0.001MB"])
def test_a_number_of_bytes_and_a_unit_plan_alike(tmp_path, text):
    layout = [(name, (100,), torch.float32) for name in "abc"]  # 400 bytes each: two fit under 1000, three do not
    writer = ShardedSafetensorsWriter(tmp_path, layout, parse_size(text))
    assert [[name for name, _, _ in shard] for shard in writer.shards] == [["a", "b"], ["c"]]
    assert writer.names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
