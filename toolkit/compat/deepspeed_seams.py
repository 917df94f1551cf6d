"""DeepSpeed's seams: dropping a ZeRO step whose gradients are finite (DeepSpeed's only drop is its overflow check),
and a module's forward run through its sequence-tiling autograd function (TiledMLP, called positionally)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from toolkit.compat import Seam
from toolkit.compat.torch_seams import replace_forward
from toolkit.errors import UserInputError

_ZERO12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
_ZERO3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
_TILING = "deepspeed.runtime.sequence_parallel.ulysses_sp"
SEAMS = [
    Seam("deepspeed", "deepspeed.runtime.engine.DeepSpeedEngine._take_model_step",
         "the engine's step, which reads the ZeRO optimizer's `overflow` after its step and counts the step as "
         "skipped (was_step_applied() false, no scheduler step): drop_zero_step makes that check see non-finite "
         "gradients; DeepSpeed has no API to drop a step whose gradients are finite"),
    Seam("deepspeed", "deepspeed.runtime.engine.DeepSpeedEngine._take_model_step.overflow", kind="in_source",
         why="the optimizer's `overflow` that _take_model_step reads to decide that a step was not applied"),
    Seam("deepspeed", f"{_ZERO12}.overflow", kind="in_source",
         why="ZeRO 1/2's verdict on the step's gradients, which _take_model_step reads (drop_zero_step)"),
    Seam("deepspeed", f"{_ZERO12}.check_grad_overflow", kind="in_source",
         why="whether ZeRO 1/2 checks the gradients at all under bf16 (deepspeed.json bf16.check_grad_overflow, which "
             "the generated config leaves on): off, drop_zero_step's step would be applied (hf_guard refuses that)"),
    Seam("deepspeed", f"{_ZERO3}.overflow", kind="in_source",
         why="ZeRO 3's verdict on the step's gradients, which _take_model_step reads (drop_zero_step)"),
    Seam("deepspeed", f"{_TILING}.TiledMLP.forward",
         "called positionally through TiledMLP.apply(fn, module, x, shards, params) by tile_forward",
         parameters=("ctx", "fn", "self", "x", "shards", "compute_params")),
    Seam("deepspeed", f"{_TILING}.sequence_tiled_compute",
         "the tiled loss's logits and cross-entropy (toolkit/backends/long_context.tile_loss), called with its first "
         "six arguments positionally",
         parameters=("fn", "seqlen", "shards", "kwargs_to_shard", "kwargs_to_pass", "grad_requiring_tensor_key",
                     "compute_params", "output_unshard_dimension", "output_reduction")),
]


def drop_zero_step(loss):
    """The loss to back-propagate so that DeepSpeed (0.19) drops the step its own way although the gradients were
    finite: its only drop is the overflow check inside engine.step() (the ZeRO optimizer's `overflow`, then
    `skipped_steps` and `was_step_applied()`), which Accelerate's DeepSpeedEngineWrapper.backward runs right after this
    backward. A non-finite loss makes every gradient non-finite, and the check drops the step: no parameter, optimizer
    state or learning-rate step changes."""
    return loss * float("nan")


def tile_forward(module, shards: Callable[[object], int]) -> None:
    """`module`'s forward (its class's forward(self, x)) run through DeepSpeed's TiledMLP: x in `shards(x)` tiles along
    the sequence, each tile's forward recomputed in backward, so no intermediate of the whole sequence is held."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    untiled = type(module).forward
    if list(inspect.signature(untiled).parameters) != ["self", "x"]:  # TiledMLP calls fn(module, x_tile)
        raise UserInputError("plan.tiled_mlp", f"{type(module).__name__}.forward takes "
                                               f"{inspect.signature(untiled)}; DeepSpeed's TiledMLP tiles only a "
                                               f"forward(self, x)")

    def forward(self, x):
        params = [p for p in self.parameters() if p.requires_grad]
        return TiledMLP.apply(untiled, self, x, shards(x), params)

    replace_forward(module, forward)
