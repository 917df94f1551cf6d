"""How fast fused attention (flash / cuDNN kernels) runs its FLOPs against the block's GEMMs: the causal half it
skips, its kernel efficiency, and its published rate by the length of the blocks it runs and by head width; a
sliding-window layer's band runs whole, at the rate of blocks as short as its window. step_time
(toolkit/estimate/timing.py) prices every fused attention FLOP with fused_attention_work."""

from __future__ import annotations

import math

CAUSAL_ATTENTION_WORK = 0.5  # flash kernels skip the masked half of the score matrix
# Fused attention (flash / cuDNN) forward + backward runs the causal half it computes at about half the rate the
# block's GEMMs reach: FlashAttention-2 on H100, fwd+bwd at training head dims, ~335 of 989 dense TFLOP/s counting the
# executed half (Dao, arXiv:2307.08691 Fig. 7; FlashAttention-3, arXiv:2407.08608 Fig. 5, speeds up mostly the forward)
# against ~60% for large GEMMs (toolkit/estimate/efficiency.py). With MFU counted over the full score matrix (PaLM),
# this also keeps every prediction at or below the GEMM efficiency's share of the peak, whatever the length.
ATTENTION_KERNEL_EFFICIENCY = 0.5
# Fused attention's rate by the length of the blocks it runs, relative to long ones: FlashAttention-3 forward, head
# dim 128, H100 SXM5 BF16 (arXiv:2407.08608 Fig. 5: 467, 565, 625, 638, 646, 648 TFLOP/s at 512 ... 16k tokens).
# Context parallelism runs its ring on blocks of seq / (2 cp) tokens (load-balanced halves, Transformer Engine's
# AttnFuncWithCPAndKVP2P), which is where short blocks cost more than their FLOPs.
ATTENTION_BLOCK_RATE = ((512, 467 / 648), (1024, 565 / 648), (2048, 625 / 648), (4096, 638 / 648), (8192, 646 / 648),
                        (16384, 1.0))
# The same figure's head dim 64 panel, relative to the same long head dim 128 blocks (arXiv:2407.08608 Fig. 5, the
# panel of the same masking: 333, 392, 460, 476, 496, 497 TFLOP/s at 512 ... 16k tokens): a head of 64 carries half
# the FLOPs per score element against the same softmax and the same loads and stores of each tile, so it runs at
# 0.71-0.77 of head dim 128's rate (cuDNN in the same panels: 0.67-0.69). Above 128 the head dim 128 rate is kept.
ATTENTION_BLOCK_RATE_HEAD_DIM_64 = ((512, 333 / 648), (1024, 392 / 648), (2048, 460 / 648), (4096, 476 / 648),
                                    (8192, 496 / 648), (16384, 497 / 648))


def _on_log2(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Interpolate `points` on log2 of x; the first point's value below it, the last's above."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            w = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + w * (y1 - y0)
    return points[-1][1]


def attention_block_rate(block_tokens: float, head_dim: int = 128) -> float:
    """Fused attention's rate on blocks of `block_tokens` at `head_dim` against long head dim 128 ones
    (ATTENTION_BLOCK_RATE and its head dim 64 panel, each interpolated on log2 of the length and between the two on
    log2 of the head dim; the shortest published length's rate below it, the longest's above)."""
    wide = _on_log2(ATTENTION_BLOCK_RATE, block_tokens)
    narrow = _on_log2(ATTENTION_BLOCK_RATE_HEAD_DIM_64, block_tokens)
    return _on_log2(((64, narrow), (128, wide)), head_dim)


def fused_attention_work(block_tokens: float, head_dim: int, window: int | None = None) -> float:
    """GEMM-rate FLOPs one counted attention FLOP costs in a fused kernel (flops.py counts the attended span whole):
    causal attention over blocks of `block_tokens` skips the masked half at the kernel's efficiency and its blocks'
    rate; a sliding window narrower than the blocks is a band the kernel runs whole (no masked half to skip), each
    query's keys a block of `window` tokens."""
    if window is not None and window < block_tokens:
        return 1 / ATTENTION_KERNEL_EFFICIENCY / attention_block_rate(window, head_dim)
    return CAUSAL_ATTENTION_WORK / ATTENTION_KERNEL_EFFICIENCY / attention_block_rate(block_tokens, head_dim)
