"""Achievable fraction of dense peak for transformer GEMMs, as a function of the per-GPU matrix width.

One curve, calibrated on published end-to-end training throughput (benchmarks/step_time_references.yaml):
Megatron-LM on A100 reaches 44-52% of peak including communication and bubbles (Narayanan et al., SC21,
arXiv:2104.04473, Table 1), Llama 3 405B on H100 38-43% MFU (Llama Team, arXiv:2407.21783, Table 4). Those figures
include communication, which toolkit/estimate/timing.py models separately, so the GEMM efficiency here sits
above them. Narrow per-GPU slices (small hidden / large TP) run less efficiently: the curve falls as the local
width shrinks, as cuBLAS GEMM benchmarks show for k, n below ~2-4K.
"""

from __future__ import annotations

import math

# Best sustained fraction of dense peak for large bf16 GEMM-dominated training steps.
PEAK_EFFICIENCY = 0.60
# Effective GEMM width at which efficiency reaches 1 - 1/e of its best.
WIDTH_SCALE = 1000.0
# Tokens per micro-batch below which kernels are too short to fill the GPU.
TOKEN_SCALE = 256.0


def gemm_efficiency(hidden: float, tp: int, tokens: float) -> float:
    """Fraction of dense peak reached by a block's GEMMs on one GPU.

    Tensor parallelism cuts one dimension of each GEMM (column-parallel: the output, row-parallel: the reduction)
    and leaves the other at `hidden`, so the effective width is the geometric mean sqrt(hidden x hidden / tp).
    """
    width = 1.0 - math.exp(-math.sqrt(hidden * hidden / tp) / WIDTH_SCALE)
    rows = 1.0 - math.exp(-tokens / TOKEN_SCALE)
    return PEAK_EFFICIENCY * width * rows
