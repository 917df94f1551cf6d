"""The learning rate and warm-up a recipe's global batch calls for, from the batch its learning rate was tuned at.

A recipe may say `training.lr_scaling: linear | sqrt` with `training.lr_reference_batch`, the global batch (sequences)
its `learning_rate` and `warmup_steps` were tuned at. `dmt generate` writes the scaled numbers into every launcher's
files (DeepSpeed JSON, trainer_args.json, megatron.yaml and its args, through the recipe it hands the generators) and
plan.json records the rule and the numbers (`lr_scaling`); a launch from the recipe alone makes the same resolution.

- linear: the learning rate grows with the batch (Goyal et al., "Accurate, Large Minibatch SGD", arXiv:1706.02677
  Sec. 2.1, SGD); sqrt: with its square root (Krizhevsky, arXiv:1404.5997; Malladi et al., arXiv:2205.10287 Sec. 4,
  the square-root rule for Adam).
- The warm-up keeps its length in samples (Goyal et al. Sec. 2.2 warm up over a fixed number of epochs), so its steps
  scale inversely with the batch, rounded, at least one where the recipe has any.
"""

from __future__ import annotations

import math

RULES = ("none", "linear", "sqrt")


def lr_factor(rule: str, global_batch: int, reference_batch: int) -> float:
    """The learning rate's multiplier at `global_batch` for a rate tuned at `reference_batch`."""
    ratio = global_batch / reference_batch
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def lr_schedule(training) -> dict | None:
    """What plan.json records (`lr_scaling`): the rule, both batches, the factor, the recipe's learning rate and
    warm-up and the scaled ones; None where the recipe scales nothing (no rule, or the batch it was tuned at)."""
    rule, reference = training.lr_scaling, training.lr_reference_batch
    if rule == "none" or reference is None or reference == training.global_batch:
        return None
    factor = lr_factor(rule, training.global_batch, reference)
    warmup = training.warmup_steps
    scaled_warmup = max(1, round(warmup * reference / training.global_batch)) if warmup else 0
    return {"rule": rule, "reference_batch": reference, "global_batch": training.global_batch,
            "factor": float(f"{factor:.6g}"), "recipe_learning_rate": training.learning_rate,
            "recipe_warmup_steps": warmup, "learning_rate": float(f"{training.learning_rate * factor:.6g}"),
            "warmup_steps": scaled_warmup}


def scaled_training(training):
    """The recipe's training section with the scaled learning rate and warm-up (itself where nothing scales)."""
    schedule = lr_schedule(training)
    if schedule is None:
        return training
    return training.model_copy(update={"learning_rate": schedule["learning_rate"],
                                       "warmup_steps": schedule["warmup_steps"]})


def with_scaled_lr(recipe):
    """The recipe every generator reads: its learning rate and warm-up scaled to its global batch."""
    return recipe.model_copy(update={"training": scaled_training(recipe.training)})
