"""Long sequences under the HF Trainer, each through the library that owns it: Ulysses sequence parallelism and
torch context parallel come from Accelerate's ParallelismConfig (built from the generated trainer arguments), tiled MLP
and tiled loss from DeepSpeed's sequence-tiling autograd functions, activation offload from torch's save_on_cpu.
What the plan turned on is read from the resolved Plan; nothing here decides a size the plan has."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from toolkit.compat.deepspeed_seams import tile_forward
from toolkit.compat.torch_seams import replace_forward
from toolkit.errors import UserInputError
from toolkit.estimate.long_context import LOSS_TILE_BYTES, loss_tile_count, sequence_tiles
from toolkit.generate.parallelism import parallelism_config

log = logging.getLogger(__name__)
# debug mode: each rank writes what its attention modules received (attention_inputs/rank<N>.json)
RECORD_ATTENTION_ENV = "DMT_RECORD_ATTENTION"
ATTENTION_RECORD_DIR = "attention_inputs"
IGNORE_INDEX = -100  # HF's label for "no loss here" (padding, prompts, the position after the last token)


def build_parallelism_config(args_dict: dict) -> None:
    """trainer_args.json's parallelism_config (ParallelismConfig's arguments) as Accelerate's own object, which the
    Trainer hands to its Accelerator: Ulysses (sp_size) under DeepSpeed, HSDP / TP / context parallel under FSDP2."""
    if isinstance(args_dict.get("parallelism_config"), dict):
        try:
            args_dict["parallelism_config"] = parallelism_config(args_dict["parallelism_config"])
        except (ValueError, TypeError) as exc:
            raise UserInputError("trainer_args.parallelism_config", f"Accelerate's ParallelismConfig refuses it: "
                                                                   f"{str(exc).splitlines()[0]}") from None


def with_position_ids(collator):
    """A collator whose batches carry position_ids (0..seq-1 per row where the rows have none): Ulysses' data loader
    adapter shards every tensor along the sequence and refuses batches without them (each shard must know its global
    positions)."""
    def collate(features):
        import torch

        batch = collator(features)
        if "position_ids" not in batch:
            rows, length = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
        return batch

    return collate


def _decoder_layers(model):
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise UserInputError("plan.tiled_mlp", f"{type(model).__name__} has no decoder `layers` to tile the MLPs of")
    return layers


def tile_mlps(model) -> int:
    """Every decoder layer's MLP computed by DeepSpeed's TiledMLP: the sequence in sequence_tiles() tiles, each MLP
    forward recomputed in backward tile by tile, so no [seq, ffn] intermediate is held. Returns the layers tiled."""
    hidden = model.config.get_text_config().hidden_size
    tiled = 0
    for layer in _decoder_layers(model):
        tile_forward(layer.mlp, lambda x: _agreed(sequence_tiles(x.shape[-2], hidden), x.device))
        tiled += 1
    return tiled


def _agreed(tiles: int, device) -> int:
    """The largest tile count of all ranks: under ZeRO-3 every rank must run the MLP as often (each call gathers)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return tiles
    value = torch.tensor(tiles, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def tile_loss(model, tile_bytes: int = LOSS_TILE_BYTES) -> None:
    """The causal LM's logits and cross-entropy computed in sequence tiles through DeepSpeed's sequence_tiled_compute:
    one tile's fp32 [tokens, vocab] logits at a time (about `tile_bytes`, the estimate's rule), recomputed in
    backward. The loss is what HF's ForCausalLMLoss
    gives (a sum over the trained tokens divided by num_items_in_batch when the Trainer passes it, by their count
    otherwise), so the Trainer's gradient accumulation and Ulysses' per-rank weighting apply unchanged.

    Not TiledFusedLogitsLoss: it runs lm_head's backward inside forward with an incoming gradient of 1, so whatever
    multiplies the loss afterwards (1/accumulation steps, Ulysses' token weighting) never reaches lm_head's gradient.
    The model's forward and HF's loss it stands in for are seams (toolkit.compat.transformers_seams): checked against
    the installed transformers, the loss by a digest of its code."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute
    from transformers.modeling_outputs import CausalLMOutputWithPast

    head = model.get_output_embeddings()
    untiled = model.forward

    def token_losses(hidden_states, labels):
        logits = head(hidden_states).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=IGNORE_INDEX, reduction="sum")

    def forward(self, input_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if labels is None and shift_labels is None:  # generation or evaluation without labels: the model's own
            return untiled(input_ids=input_ids, **kwargs)
        kwargs.pop("logits_to_keep", None)
        outputs = self.get_decoder()(input_ids=input_ids, **kwargs)
        states = outputs.last_hidden_state
        if shift_labels is None:  # position i predicts label i + 1, as ForCausalLMLoss shifts them
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        shift_labels = shift_labels.to(states.device)
        length = states.shape[1]
        total = sequence_tiled_compute(token_losses, length, loss_tile_count(states.shape[0] * length, head.out_features, tile_bytes),
                                       {"hidden_states": states, "labels": shift_labels}, {}, "hidden_states",
                                       compute_params=[p for p in head.parameters() if p.requires_grad],
                                       output_unshard_dimension=0, output_reduction="sum")
        items = num_items_in_batch if num_items_in_batch is not None else (shift_labels != IGNORE_INDEX).sum()
        if torch.is_tensor(items):
            items = items.to(total.device)
        return CausalLMOutputWithPast(loss=total / items, logits=None, past_key_values=outputs.past_key_values)

    replace_forward(model, forward)


def ulysses_gradient(loss, sp: int):
    """The Ulysses loss with its gradient divided by sp, its value unchanged (what is logged stays the loss).

    transformers' deepspeed_sp_compute_loss (integrations/deepspeed.py) makes every SP rank's loss the token-weighted
    mean of all ranks' losses through a differentiable all_gather, whose backward sums what every rank sends: each
    rank's share of the gradient arrives sp times. DeepSpeed then sums over the SP ranks rather than averaging (ZeRO's
    reduction divides by dp_world_size / sequence_parallel_size, runtime/zero/stage_1_and_2.py). Uncorrected, the
    gradient (and grad_norm, and so clipping) is sp times the sp=1 run's; Adam hides most of it, SGD and clipping do
    not (measured: grad_norm 3.387 at sp=2 against 1.694 at sp=1 on the same batch)."""
    import torch

    class ScaledGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value):
            return value.view_as(value)

        @staticmethod
        def backward(ctx, grad):
            return grad / sp

    return ScaledGradient.apply(loss)


def activation_offload(plan):
    """The context a training step runs in: with offload_activations cpu, every tensor autograd saves for backward
    (with recompute full, the checkpointed layer inputs) is kept in host memory until backward needs it."""
    if plan.offload_activations != "cpu":
        return contextlib.nullcontext()
    import torch

    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def record_attention_inputs(model, attention: str, output_dir: Path, rank: int) -> None:
    """Debug mode (DMT_RECORD_ATTENTION=1): the sequence length each decoder layer's attention receives on this rank,
    and the attention function it calls (`attention`, the plan's kernels the model was built with: Ulysses puts
    DeepSpeed's all-to-all wrapper in transformers' registry under that name), written at each forward to attention_inputs/rank<N>.json; what the tests
    read to prove the sequence is split."""
    if os.environ.get(RECORD_ATTENTION_ENV) != "1":
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    directory = output_dir / ATTENTION_RECORD_DIR
    directory.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "forwards": []}

    def seen(module, args, kwargs):
        states = kwargs.get("hidden_states", args[0] if args else None)
        if module is first:
            record["forwards"].append([])
        record["forwards"][-1].append(int(states.shape[1]))
        function = ALL_ATTENTION_FUNCTIONS[attention]  # Ulysses replaces the entry of the model's own kernels
        record["attention_function"] = f"{function.__module__}.{function.__qualname__}"
        (directory / f"rank{rank}.json").write_text(json.dumps(record))

    layers = _decoder_layers(model)
    first = layers[0].self_attn
    for layer in layers:
        layer.self_attn.register_forward_pre_hook(seen, with_kwargs=True)


def prepare(model, plan, output_dir: Path, rank: int) -> None:
    """The model changed for the plan's tiling options (before the Trainer wraps it), and the debug record hooked."""
    if plan.tiled_mlp:
        log.info("tiled MLP: %d decoder layers' MLPs through DeepSpeed's TiledMLP", tile_mlps(model))
    if plan.tiled_loss:
        tile_loss(model)
        log.info("tiled loss: logits and cross-entropy through DeepSpeed's sequence_tiled_compute")
    record_attention_inputs(model, plan.attention, output_dir, rank)
