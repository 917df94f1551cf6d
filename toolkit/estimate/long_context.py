"""What splitting and tiling a long sequence adds to one rank's memory and step: the sequence tiles' working sets
(DeepSpeed's TiledMLP and TiledFusedLogitsLoss), Ulysses' all-to-all buffers and the context-parallel ring's, and
the time the tiles' recomputation and the sequence split's exchanges take. What each layer keeps for backward is
activations.py's; this module holds the transient terms on top of it, and the tile sizes the libraries choose.
"""

from __future__ import annotations

import math

from toolkit.estimate.activations import FP32, ActivationSetup, mlp_bytes_per_token, ulysses_kv_copies
from toolkit.numeric import GiB
from toolkit.spec.model import ModelSpec

# TiledFusedLogitsLoss tiles of about 1 GiB of fp32 logits: ArcticTraining's `slice_size_in_gb = 1`
# (snowflakedb/ArcticTraining, arctic_training/trainer/sft_trainer.py) and the DeepSpeed ALST tutorial's loss
LOSS_TILE_BYTES = 1 * GiB


def sequence_tiles(tokens: int, hidden_size: int) -> int:
    """TiledMLP's shards of `tokens`: ceil(tokens / hidden size), the count DeepSpeed's TiledMLP docstring and ALST's
    patched HF MLP use (runtime/sequence_parallel/ulysses_sp.py), so a tile's [tile, ffn] tensors are about as large
    as [s, hidden]. Training tiles the MLPs with it (toolkit/backends/long_context.py)."""
    return max(1, math.ceil(tokens / hidden_size))


def loss_tile_count(tokens: int, vocab_size: int, tile_bytes: int = LOSS_TILE_BYTES) -> int:
    """The logits+loss tiles of `tokens`: as many as keep each tile's fp32 logits near `tile_bytes`. Training tiles
    the loss with it (toolkit/backends/long_context.py)."""
    return max(1, math.ceil(tokens * vocab_size * FP32 / tile_bytes))


def mlp_tiles(spec: ModelSpec, setup: ActivationSetup) -> int:
    """TiledMLP's shards of one rank's sequence (sequence_tiles of the local sequence)."""
    return sequence_tiles(setup.seq_len // (setup.cp * setup.sp), spec.hidden_size)


def loss_tiles(spec: ModelSpec, setup: ActivationSetup) -> int:
    """TiledFusedLogitsLoss's shards of one rank's tokens (loss_tile_count)."""
    return loss_tile_count(setup.tokens, spec.vocab_size)


def sequence_working_bytes(spec: ModelSpec, setup: ActivationSetup, last_stage: bool) -> dict[str, int]:
    """Transient bytes beside the saved activations, by name (the estimate's overhead terms): the largest of them
    lives at a time, but they are listed apart so that `dmt estimate` can say which option paid for what."""
    a, tokens = setup.act_bytes, setup.tokens
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    terms: dict[str, int] = {}
    if setup.sp > 1:
        # one layer's q, k, v after the all-to-all beside the sequence-sharded ones (and the output's way back)
        terms["ulysses_all_to_all"] = int(a * (q + 2 * kv * ulysses_kv_copies(spec, setup.sp)) * tokens)
    if setup.cp > 1 and setup.hf_modules:
        # torch's ring attention: the next rank's k and v in flight in forward; in backward also their gradients,
        # accumulated in fp32 as they travel back
        terms["cp_ring_buffers"] = int(2 * kv * (a + FP32) * tokens)
    if setup.tiled_mlp and not spec.is_moe:
        tile = math.ceil(tokens / mlp_tiles(spec, setup))
        # backward: one tile's MLP recomputed with its saved tensors and their gradients, and the whole input's
        # gradient TiledMLP fills tile by tile
        terms["tiled_mlp_tile"] = int(tile * 2 * mlp_bytes_per_token(spec, a, spec.ffn_hidden_size, setup)
                                      + tokens * a * spec.hidden_size)
    if setup.tiled_loss and last_stage:
        tile = math.ceil(tokens / loss_tiles(spec, setup))
        # one tile's logits in the compute dtype, their fp32 log-softmax and its gradient
        terms["tiled_loss_tile"] = int(tile * spec.vocab_size * (a + 2 * FP32))
    return terms


def tile_recompute_forwards(tiled_mlp: bool) -> float:
    """MLP forwards the tiles run again in backward: TiledMLP recomputes its forward tile by tile (its docstring: 'the
    forward occurs twice'); TiledFusedLogitsLoss runs its backward inside forward, so it repeats nothing."""
    return 1.0 if tiled_mlp else 0.0
