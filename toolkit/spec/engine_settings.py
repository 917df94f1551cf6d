"""The settings the toolkit gives the training libraries that both the memory model counts and the generated files
write: one place below both (the backends' memory parts, toolkit/generate/ and toolkit/validate/)."""

from __future__ import annotations

# DeepSpeed's ZeRO buckets and prefetch as deepspeed.json sets them (deepspeed/runtime/zero/config.py names them):
# reduce_bucket_size, allgather_bucket_size, stage3_prefetch_bucket_size, stage3_max_live_parameters, in elements.
DS_REDUCE_BUCKET_ELEMENTS = 500_000_000
DS_ALLGATHER_BUCKET_ELEMENTS = 500_000_000
DS_STAGE3_PREFETCH_ELEMENTS = 50_000_000
DS_STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
# ZeRO-1/2 allocate their gradient buckets at full reduce_bucket_size, twice with overlap_comm (double buffering,
# stage_1_and_2.py setup_buckets); the generated configs turn overlap_comm on.
DS_OVERLAP_COMM = True

# Megatron pads the vocabulary so each tensor-parallel shard is a multiple of this (--make-vocab-size-divisible-by).
MEGATRON_VOCAB_DIVISIBLE_BY = 128


def megatron_padded_vocab(vocab_size: int, tp: int) -> int:
    """Megatron pads the embedding and output layer's vocabulary to a multiple of 128 x tp."""
    multiple = MEGATRON_VOCAB_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple
