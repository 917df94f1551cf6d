"""Shared fixtures: tiny models built from configs, offline environment."""

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def tiny_llama_config(**overrides) -> dict:
    """A small HF Llama config.json dict (random init, no hub)."""
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=0,
        eos_token_id=0,
    )
    config.update(overrides)
    return config


@pytest.fixture
def tiny_llama_dir(tmp_path):
    """A directory holding a tiny Llama config.json, as `--model DIR` expects."""
    path = tmp_path / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_llama_config()))
    return path
