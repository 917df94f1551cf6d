"""HF config.json -> ModelSpec by the family readers: a config that holds every key is read without torch or
transformers and gives the spec transformers' own config gives; a key left to the library's default is filled in by
transformers; bad values name their key."""

import json
import subprocess
import sys

import pytest

from toolkit.errors import UserInputError
from toolkit.families import ALIASES, FAMILIES
from toolkit.spec.model import PRESET_DIR, load_model_spec, preset_names, spec_from_hf_dict

# Presets whose config.json holds every key their family's reader needs (the others leave one to the library).
COMPLETE_PRESETS = ["llama-3.1-8b", "mixtral-8x7b", "qwen2.5-7b", "qwen3-8b", "qwen3-30b-a3b", "phi-3-mini",
                    "deepseek-v3", "kimi-k2", "gpt-oss-20b"]


def _preset(name: str) -> dict:
    return json.loads((PRESET_DIR / f"{name}.json").read_text())


def _through_transformers(data: dict, name: str):
    """The spec of the config transformers builds from `data` (every default filled in)."""
    from transformers import AutoConfig

    model_type = ALIASES.get(data["model_type"], data["model_type"])  # kimi_k2: transformers builds it as deepseek_v3
    config = AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if k != "model_type"})
    return spec_from_hf_dict(config.to_dict(), name, filled=True)


def test_complete_configs_of_every_family_read_without_torch_or_transformers(tmp_path):
    """The presets that hold every key, and for the families whose presets do not, the same preset with the keys it
    leaves to transformers written out (as a config.json saved by transformers has them)."""
    from transformers import AutoConfig

    sources = list(COMPLETE_PRESETS)
    for preset in ("mistral-7b-v0.1", "gemma-2-9b", "gpt2", "pythia-1b", "opt-1.3b"):
        data = _preset(preset)
        filled = AutoConfig.for_model(data["model_type"]).to_dict()
        path = tmp_path / f"{preset}.json"
        path.write_text(json.dumps({**filled, **data}))
        sources.append(str(path))
    assert {_preset(p)["model_type"] for p in COMPLETE_PRESETS} | {"mistral", "gemma2", "gpt2", "gpt_neox", "opt"} \
           == set(FAMILIES) | set(ALIASES)
    code = ("import sys; from toolkit.spec.model import load_model_spec; "
            "specs = [load_model_spec(s) for s in sys.argv[1:]]; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "print(len(specs), heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code, *sources], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split()[0] == str(len(sources))


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_reads_the_same_as_through_transformers_config(preset):
    assert load_model_spec(preset) == _through_transformers(_preset(preset), preset)


TINY_QWEN3 = dict(model_type="qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, intermediate_size=512, vocab_size=1000, max_position_embeddings=128,
                  tie_word_embeddings=False, hidden_act="silu", attention_dropout=0.0, attention_bias=False)


def test_a_key_left_to_the_library_takes_the_library_default():
    # Qwen3Config defaults head_dim to 128 where hidden/heads would be 64
    assert spec_from_hf_dict(TINY_QWEN3, "tiny").head_dim == 128
    assert spec_from_hf_dict({**TINY_QWEN3, "head_dim": 64}, "tiny").head_dim == 64
    # an absent num_key_value_heads is the attention heads for Llama, 8 for Mistral
    llama = {k: v for k, v in _preset("llama-3.1-8b").items() if k != "num_key_value_heads"}
    mistral = {k: v for k, v in _preset("mistral-7b-v0.1").items() if k != "num_key_value_heads"}
    assert (load_model_spec("llama-3.1-8b").num_kv_heads, spec_from_hf_dict(llama, "llama").num_kv_heads) == (8, 32)
    assert spec_from_hf_dict(mistral, "mistral").num_kv_heads == 8
    gpt2 = _preset("gpt2")  # no tie_word_embeddings: GPT2Config ties them
    assert "tie_word_embeddings" not in gpt2 and spec_from_hf_dict(gpt2, "gpt2").tie_embeddings


def test_values_transformers_derives_are_derived_the_same_way():
    llama = {k: v for k, v in _preset("llama-3.2-1b").items() if k != "head_dim"}
    assert spec_from_hf_dict(llama, "llama").head_dim == 2048 // 32
    assert spec_from_hf_dict({**llama, "num_key_value_heads": None}, "llama").num_kv_heads == 32
    gpt2 = {**_preset("gpt2"), "tie_word_embeddings": True}
    assert spec_from_hf_dict({**gpt2, "n_inner": None}, "gpt2").ffn_hidden_size == 4 * 768
    assert spec_from_hf_dict({**gpt2, "n_inner": 1000}, "gpt2").ffn_hidden_size == 1000
    moe = _preset("qwen3-30b-a3b")
    sparse = spec_from_hf_dict({**moe, "decoder_sparse_step": 2, "mlp_only_layers": [1, 5]}, "moe")
    assert sparse.moe_layers == tuple(i for i in range(48) if (i + 1) % 2 == 0 and i not in (1, 5))
    dense = spec_from_hf_dict({**moe, "mlp_only_layers": list(range(48))}, "moe")
    assert (dense.num_experts, dense.moe_layers) == (0, None)


@pytest.mark.parametrize("preset, key, allowed", [
    ("llama-3.1-8b", "attention_dropout", True), ("qwen2.5-7b", "num_key_value_heads", True),
    ("mixtral-8x7b", "num_key_value_heads", False), ("qwen3-8b", "head_dim", False),
    ("qwen2.5-7b", "attention_dropout", False),
])
def test_null_is_read_only_where_the_transformers_config_class_allows_it(preset, key, allowed):
    data = {**_preset(preset), key: None}
    if allowed:
        assert spec_from_hf_dict(data, "x") == _through_transformers(data, "x")
    else:
        with pytest.raises(UserInputError, match="must be an integer|must be a number"):
            spec_from_hf_dict(data, "x")


def test_transformers_5_config_dicts_read_too():
    """A saved transformers 5 config: rope_parameters instead of rope_theta, qwen3_moe's num_local_experts."""
    from transformers import AutoConfig

    data = _preset("qwen3-30b-a3b")
    saved = AutoConfig.for_model("qwen3_moe", **{k: v for k, v in data.items() if k != "model_type"}).to_dict()
    assert "num_local_experts" in saved and "num_experts" not in saved and "rope_parameters" in saved
    assert spec_from_hf_dict(saved, "saved") == load_model_spec("qwen3-30b-a3b").model_copy(update={"name": "saved"})


@pytest.mark.parametrize("change, key, says", [
    (dict(hidden_size="4096"), "hidden_size", "must be an integer"),
    (dict(hidden_size=4096.0), "hidden_size", "must be an integer"),
    (dict(attention_bias="no"), "attention_bias", "true or false"),
    (dict(hidden_act=None), "hidden_act", "must be a string"),
    (dict(hidden_act="tanh"), "hidden_act", "activation 'tanh' is not supported"),
    (dict(num_attention_heads=30), "num_attention_heads", "hidden size (4096) is not a multiple"),
    (dict(num_hidden_layers=0), "num_hidden_layers", "must be a positive integer"),
    (dict(model_type="t5"), "model_type", "supported: deepseek_v3, gemma2, gpt2, gpt_neox, gpt_oss, kimi_k2, llama"),
])
def test_bad_values_name_their_key(change, key, says):
    with pytest.raises(UserInputError) as err:
        spec_from_hf_dict({**_preset("llama-3.1-8b"), **change}, "cfg")
    assert err.value.key.endswith(key) and says in err.value.message, (err.value.key, err.value.message)


def test_a_filled_config_without_a_key_names_it():
    data = {k: v for k, v in _preset("llama-3.1-8b").items() if k != "vocab_size"}
    with pytest.raises(UserInputError) as err:
        spec_from_hf_dict(data, "cfg", filled=True)
    assert err.value.key == "cfg: vocab_size" and "lacks" in err.value.message
