"""Training a Megatron-Core plan: the toolkit's own loop over Megatron-Core (toolkit/backends/megatron/training.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.backends.megatron.training import train as train_megatron

if TYPE_CHECKING:
    from toolkit.backends.context import TrainContext

TRAINER_HOOKS = None  # it trains Megatron-Core's modules in its own loop, not the HF Trainer's


def train(context: TrainContext) -> dict:
    """train.py's entry (the same for every backend): the generated megatron.yaml trains."""
    return train_megatron(context.recipe, context.model, context.plan, context.output_dir, context.resume,
                          context.run.megatron, context.throughput, context.watch)
