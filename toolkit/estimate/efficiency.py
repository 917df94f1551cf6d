"""How fast each execution path computes: the achievable fraction of dense peak for a block's GEMMs, per path.

The curve (gemm_efficiency) is calibrated on published end-to-end training throughput of fused-kernel stacks
(benchmarks/step_time_references.yaml): Megatron-LM on A100 reaches 44-52% of peak including communication and
bubbles (Narayanan et al., SC21, arXiv:2104.04473, Table 1), Llama 3 405B on H100 38-43% MFU (Llama Team,
arXiv:2407.21783, Table 4), Megatron-Bridge's H100 FP8 Llama 3 rows (docs/performance-summary*.md of
NVIDIA-NeMo/Megatron-Bridge). Those figures include communication, which toolkit/estimate/timing.py models
separately, so the GEMM efficiency here sits above them. Narrow per-GPU slices (small hidden / large TP) run less
efficiently: the curve falls as the local width shrinks, which stands for the non-GEMM work (norms, rotary,
activations, kernel launches) whose share grows as layers get narrower (bare bf16 GEMMs saturate at ~0.75 of an
H100's peak from h = 2048 on: benchmarks/gpu_check.md).

The execution paths differ in the kernels that run between and around the GEMMs, so each has its own rate
(ExecutionPath.compute_scale, relative to the fused curve) and attention kernel:
- megatron-te: Megatron-Core with Transformer Engine (fused norm+linear, fused rotary, fused SwiGLU, cuDNN/flash
  attention): the curve itself.
- hf: the HF transformers modules the deepspeed and fsdp backends train (eager PyTorch RMSNorm, rotary and SwiGLU,
  SDPA flash attention), under DeepSpeed's engine or FSDP2's hooks.
- megatron-local: Megatron-Core's local spec (torch norms, unfused rotary and activation, and an unfused core
  attention that writes the score matrix to memory: counted separately, UNFUSED_ATTENTION_BYTES).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from toolkit.spec.backends import backend_of
from toolkit.spec.calibration import Calibration
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan

# Best sustained fraction of dense peak for large bf16 GEMM-dominated training steps (fused kernels).
PEAK_EFFICIENCY = 0.60
# The most of the host's peak a host calibration's GEMMs (and the work between them) reach at any width and length:
# the published curve's own ceiling. With the width held at the widest run's (ExecutionPath.fitted_width) no plan is
# predicted above it, so an 8B model on a calibration fitted to a tiny model's CPU runs is no longer at 100% MFU
# (estimate/calibrate.py fit_host_paths raises the host peak to keep the runs' GEMMs under it).
HOST_GEMM_CEILING = PEAK_EFFICIENCY
# Effective GEMM width at which efficiency reaches 1 - 1/e of its best.
WIDTH_SCALE = 1000.0
# Rows (tokens) of a GEMM below which it is too short to fill the GPU: 1 - exp(-M / TOKEN_SCALE) of the large-GEMM
# rate. DeepGEMM's published H800 FP8 table (deepseek-ai/DeepGEMM README, Feb 2025; N x K = 4096 x 7168) runs
# M = 64 / 128 at 0.22 / 0.41 of its M = 4096 rate, and its grouped (MoE) GEMMs at 512 / 1,024 rows per group at
# 0.80 / 0.95 and at 4,096 rows per group at 0.99: the curve below gives 0.22, 0.39, 0.86, 0.98, 1.0. A grouped
# GEMM runs at the rate of one GEMM of its rows per group (expert_gemm_efficiency).
TOKEN_SCALE = 256.0


@dataclass(frozen=True)
class ExecutionPath:
    """The kernels a plan's training runs, and how fast they go against the fused curve."""

    name: str
    description: str
    compute_scale: float  # rate of the execution path's GEMMs and the work between them, relative to gemm_efficiency
    unfused_attention: bool  # the core attention writes the s x s scores to memory (no flash kernel)
    source: str
    # seconds every optimizer step costs whatever its size (the Trainer's and the engine's per-step work, logging,
    # the data loader, synchronisation): 0 as published (small against a large model's step on a GPU); `dmt
    # calibrate` fits it with the compute scale where the runs can tell the two apart
    fixed_step_s: float = 0.0
    # rotary embedding in Transformer Engine's fused kernel (its rate is the curve's), where the model allows it
    fused_rotary: bool = False
    # a host calibration's widest fitted width (effective_width of its widest run): past it the curve's width term is
    # held at its value there (path_gemm_efficiency), the runs telling nothing of how much faster wider GEMMs go
    fitted_width: float | None = None


# The eager execution path's rate, from two measured runs of un-fused PyTorch modules on H100
# (benchmarks/step_time_accuracy.md reproduces both rows with this value):
# - torchtitan Llama 3.1 8B, FSDP2 on 8 H100s, local batch 2 x 8192, bf16, no torch.compile, no float8: 5,762
#   tokens/s/GPU (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1): its RMSNorm, rotary
#   and SwiGLU are eager PyTorch as in HF's Llama, attention SDPA's flash kernel; 2.84 s against 1.64 s on the curve.
# - the toolkit's own run of HF Llama 3.2 1B under DeepSpeed ZeRO-2 on one H100, seq 2048, micro-batch 4 (the HF
#   Trainer): 0.254 s, 27% MFU (benchmarks/gpu_check.md), against 0.145 s on the curve.
# Both are 0.57-0.58 of the fused rate (1.75x); the gap does not shrink from h = 2048 to 4096 as a term of
# elementwise memory traffic (which grows with h, GEMMs with h^2) would, so it is a rate, not a per-token cost.
EAGER_COMPUTE_SCALE = 0.57

HF = ExecutionPath(
    "hf", "HF modules (eager PyTorch norms, rotary and SwiGLU; SDPA flash attention)", EAGER_COMPUTE_SCALE, False,
    "torchtitan Llama 3.1 8B FSDP2 eager on 8 H100 (benchmarks/llama3_h100_202412_torchtitan.md, Table 1); "
    "benchmarks/gpu_check.md (HF Llama 3.2 1B, DeepSpeed ZeRO-2, one H100)")
MEGATRON_TE = ExecutionPath(
    "megatron-te", "Megatron-Core with Transformer Engine (fused kernels, cuDNN/flash attention)", 1.0, False,
    "arXiv:2104.04473 Table 1; arXiv:2407.21783 Table 4; Megatron-Bridge H100 performance summary",
    fused_rotary=True)
MEGATRON_LOCAL = ExecutionPath(
    "megatron-local", "Megatron-Core local spec (torch norms, unfused rotary and SwiGLU, unfused core attention)",
    EAGER_COMPUTE_SCALE, True,
    "the eager rate as for hf; the unfused attention's memory traffic counted from Megatron-Core 0.16.1's "
    "DotProductAttention and FusedScaleMaskSoftmax.forward_torch_softmax; checked against benchmarks/gpu_check.md")
EXECUTION_PATHS = {path.name: path for path in (MEGATRON_TE, MEGATRON_LOCAL, HF)}

# Bytes moved per element of the s x s score matrix, forward + backward, when Megatron-Core's local DotProductAttention
# falls back to torch's softmax (no Apex/Megatron fused softmax kernel, as on an image without them): forward baddbmm
# writes bf16 scores (2), .float() reads and writes (2 + 4), the causal masked_fill (4 + 1 + 4), softmax (4 + 4),
# the cast back (4 + 2), the bmm with V reads the probabilities (2): 33; backward the probabilities' gradient and the
# probabilities for dV (2 + 2), the cast (2 + 4), softmax backward (4 + 4 + 4), masked_fill (4 + 1 + 4), the cast
# (4 + 2), baddbmm's backward reads the scores' gradient twice (2 + 2): 41.
UNFUSED_ATTENTION_FORWARD_BYTES = 33
UNFUSED_ATTENTION_BACKWARD_BYTES = 41


# Elements of the queries and keys moved per element, forward and backward, when Megatron-Core applies rotary
# embedding in eager PyTorch (rope_utils._apply_rotary_pos_emb_bshd): forward t * cos (read, write), _rotate_half's
# negated half and torch.cat (1 + 2), x * sin (2), the sum (3), the cat with the unrotated rest (2): 12; backward the
# gradient times sin and times cos (2 + 2), the negation and the halves put back together (1 + 2), the two gradients
# of t summed (3): 10.
UNFUSED_ROTARY_FORWARD_ELEMENTS = 12
UNFUSED_ROTARY_BACKWARD_ELEMENTS = 10


def unfused_rotary_elements(spec: ModelSpec, path: ExecutionPath) -> tuple[int, int]:
    """Elements moved per token and layer (forward, backward) by rotary embedding outside a fused kernel, on an
    execution path whose rate assumes the fused one: Megatron-Core runs it eagerly when YaRN's attention factor is not 1
    (rope_utils.apply_rotary_pos_emb: "mscale ... is not supported by TE's fused RoPE"; Megatron-Bridge also turns
    apply_rope_fusion off for position_embedding_type "yarn", fusions.validate_rope_fusion_compatibility, which its
    GPT-OSS bridge sets). The eager execution paths' own rate already carries their unfused rotary."""
    if not path.fused_rotary or spec.rope_attention_factor == 1.0 or spec.position_embedding != "rope":
        return 0, 0
    width = (spec.num_attention_heads + spec.num_kv_heads) * spec.head_dim
    return UNFUSED_ROTARY_FORWARD_ELEMENTS * width, UNFUSED_ROTARY_BACKWARD_ELEMENTS * width


def execution_path(plan: Plan) -> ExecutionPath:
    """The path a plan trains on, as its backend says (its timing part's `execution_path`): the HF modules, or
    Megatron-Core's Transformer Engine or local layers."""
    return backend_of(plan).timing.execution_path(plan)


def effective_width(hidden: float, tp: int) -> float:
    """Tensor parallelism cuts one dimension of each GEMM (column-parallel: the output, row-parallel: the reduction)
    and leaves the other at `hidden`, so the effective width is the geometric mean sqrt(hidden x hidden / tp)."""
    return math.sqrt(hidden * hidden / tp)


def gemm_efficiency(hidden: float, tp: int, tokens: float) -> float:
    """Fraction of dense peak reached by a block's GEMMs on one GPU with fused kernels (at effective_width)."""
    width = 1.0 - math.exp(-effective_width(hidden, tp) / WIDTH_SCALE)
    rows = 1.0 - math.exp(-tokens / TOKEN_SCALE)
    return PEAK_EFFICIENCY * width * rows


def path_gemm_efficiency(path: ExecutionPath, hidden: float, tp: int, tokens: float) -> float:
    """Fraction of peak a path's GEMMs reach: the curve times the path's compute scale, at most the peak; on a
    host calibration's path, at no width past its widest fitted run's (ExecutionPath.fitted_width). The curve rises
    with width towards PEAK_EFFICIENCY, and a scale fitted on a tiny model's narrow GEMMs (a CPU run) is many times
    the published one: carried to an 8B model's width it put every GEMM at the peak (100% MFU). Held at the widest
    run's width, a wider model computes at the rate the runs showed, never faster."""
    if path.fitted_width is not None and effective_width(hidden, tp) > path.fitted_width:
        hidden, tp = path.fitted_width, 1
    return min(1.0, gemm_efficiency(hidden, tp, tokens) * path.compute_scale)


def expert_gemm_efficiency(hidden: float, ffn: float, expert_tp: int, rows_per_expert: float) -> float:
    """Fraction of dense peak reached by a grouped GEMM of routed experts: the rate of one GEMM of `rows_per_expert`
    rows (the tokens each local expert receives) over the expert's h x ffn/etp weights (TOKEN_SCALE's source)."""
    return gemm_efficiency(expert_hidden(hidden, ffn), expert_tp, rows_per_expert)


def expert_hidden(hidden: float, ffn: float) -> float:
    """The `hidden` of gemm_efficiency an expert's h x ffn weights stand for: their geometric mean."""
    return math.sqrt(hidden * ffn)


def calibrated_path(path: ExecutionPath, calibration: Calibration | None) -> ExecutionPath:
    """The path with the compute scale and fixed per-step cost `dmt calibrate` fitted for it on this hardware, else
    as published. A fitted scale may put a path's product with the curve above 1 (a CPU host on a tiny model, whose
    narrow GEMMs the GPU-shaped curve marks down far more than the host does); step_time caps the product at the
    peak."""
    fitted = calibration.efficiency.get(path.name) if calibration is not None else None  # type: ignore[call-overload]
    if fitted is None:
        return path
    return dataclasses.replace(path, compute_scale=fitted.compute_scale, fixed_step_s=fitted.fixed_step_s,
                               fitted_width=fitted.fitted_width)
