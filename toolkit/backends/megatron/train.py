"""Training a Megatron-Core plan: the toolkit's own loop over Megatron-Core (toolkit/backends/megatron/training.py)."""

from __future__ import annotations

HF_PATH = None  # it trains Megatron-Core's modules in its own loop, not the HF Trainer's


def train(run, recipe, output_dir, resume, deepspeed_json, updates, throughput, watch) -> dict:
    """train.py's entry (the same for every backend): the generated megatron.yaml trains."""
    from toolkit.backends.megatron.training import train as train_megatron

    return train_megatron(recipe, run.model, run.plan, output_dir, resume, run.megatron, throughput, watch)
