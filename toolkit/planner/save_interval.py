"""`training.save_steps: auto`: Daly's optimum checkpoint interval, in steps, for a recipe's planned step time.

`dmt generate` resolves it once and writes the number into the generated files (trainer_args.json's save_steps,
megatron.yaml's schedule.save_interval and --save-interval) and plan.json's `save_interval` (the number and what it
was computed from); toolkit/train.py takes the number from plan.json, or resolves it the same way without one.
"""

from __future__ import annotations

from toolkit.estimate.training_time import FailureInputs, record_training_time
from toolkit.planner.recipe import recipe_prediction
from toolkit.spec.backends import backend_of
from toolkit.spec.prediction import Prediction
from toolkit.spec.recipe import Recipe, recipe_calibration

AUTO = "auto"


def is_auto(recipe: Recipe) -> bool:
    return recipe.training.save_steps == AUTO


def auto_save_interval(prediction: Prediction, max_steps: int, async_save: bool) -> dict:
    """The interval in steps for a run of `max_steps` at the prediction's step time, and why: plan.json's
    `save_interval` record (the checkpoint's cost, the failure model, Daly's optimum)."""
    plan = prediction.plan
    inputs = FailureInputs(async_save=async_save)  # as this run will save (recipe_saves_async)
    timed = record_training_time(prediction, max_steps * plan.global_batch * plan.seq_len, inputs)
    checkpoint = timed["checkpoint"]
    return {
        "save_steps": checkpoint["interval_steps"],
        "rule": "Daly's higher-order optimum interval (FGCS 2006) for the blocking time of one save and the job's "
                "mean time between failures, in whole steps of the predicted step time (at most max_steps)",
        "step_time_s": prediction.step_time_s, "interval_s": checkpoint["interval_s"],
        "checkpoint_bytes": checkpoint["bytes"], "write_s": checkpoint["write_s"],
        "blocking_s": checkpoint["blocking_s"], "async_save": checkpoint["async_save"],
        "write_bw_gbps_per_node": checkpoint["write_bw_gbps_per_node"],
        "failure_rate_per_gpu_hour": timed["failure_rate_per_gpu_hour"], "mtbf_h": timed["mtbf_h"],
        "gpus": plan.gpus, "max_steps": max_steps,
    }


def run_save_steps(recipe: Recipe, model, plan, record: dict | None) -> int:
    """The number a launch of an `auto` recipe saves at: plan.json's (what `dmt generate` wrote into the files), or,
    launched from the recipe alone, the same resolution made now."""
    if record is not None and isinstance(record.get("save_interval"), dict):
        return int(record["save_interval"]["save_steps"])

    prediction = recipe_prediction(recipe, model, plan, recipe_calibration(recipe))
    return auto_save_interval(prediction, recipe.training.max_steps, recipe_saves_async(recipe, plan))["save_steps"]


def recipe_saves_async(recipe: Recipe, plan) -> bool:
    """Whether this recipe's run writes its checkpoints in the background (what megatron.yaml's async_save says)."""
    return backend_of(plan).saves_async(recipe.training.async_save, recipe.cluster.accelerator)


def with_save_steps(recipe: Recipe, save_steps: int) -> Recipe:
    """The recipe with a number in place of `save_steps: auto`."""
    return recipe.model_copy(update={"training": recipe.training.model_copy(update={"save_steps": save_steps})})
