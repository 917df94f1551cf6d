"""Transformer Engine's fp8 and fp4 recipes: what each stores beside (or instead of) the bf16 tensors, which peak its
GEMMs run at, and which GPUs have its kernels.

Megatron-Core runs its Transformer Engine layers' GEMMs (the linear layers of attention and the MLP, experts included)
inside `fp8_autocast` with the recipe TransformerConfig.fp8_recipe / fp4_recipe names (megatron/core/fp8_utils.py
get_fp8_recipe, fp4_utils.py get_fp4_recipe); norms, attention's softmax (fp8_dot_product_attention is off), the
embedding and the output layer stay bf16. What the recipes keep, read in Transformer Engine's source
(transformer_engine/pytorch/module/linear.py, tensor/*_tensor.py, quantization.py; NVIDIA/TransformerEngine main):

- A GEMM's weight, quantized once per step and cached across micro-batches (Megatron-Core passes
  `is_first_microbatch`, extensions/transformer_engine.py; TE keeps the workspace in `_fp8_workspaces`), in both
  usages: row-wise for the forward GEMM and column-wise for the input-gradient GEMM (quantize_weight with
  `columnwise=is_grad_enabled`). Hopper's fp8 GEMMs take TN operands only, so the column-wise usage of a per-tensor
  recipe is a transposed copy (`non_tn_fp8_gemm_supported` is major >= 10); the block recipes keep two layouts with
  their own scales on every part (MXFP8: one E8M0 scale per 32 elements each way; NVFP4: an E4M3 scale per 16
  fp4 elements each way; blockwise: an fp32 scale per 128 x 128 weight block). With `--fp8-param-gather`
  (TransformerConfig.fp8_param, fp8_model_init) the weight *is* that quantized tensor: the bf16 copy is gone and the
  fp32 master lives in the distributed optimizer.
- A GEMM's input, saved for the weight-gradient GEMM quantized and in its column-wise usage only (linear.py: "Discard
  row-wise data since it is not needed in backward pass"): 1 byte an element in fp8 (plus a scale per block), where
  bf16 keeps 2. The activation function's input (fc1's output) and attention's q, k, v and output stay bf16.

The estimate does not take the GPU, so per-tensor recipes are counted with Hopper's transposed copy everywhere (one
byte a GEMM weight more than a Blackwell part keeps with delayed or tensorwise scaling).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserInputError
from toolkit.spec.cluster import GPU, capability

FP8, FP4 = "fp8", "fp4"
LOW_PRECISION = (FP8, FP4)  # the precisions whose GEMMs run in Transformer Engine's recipes
BF16_COMPUTE = ("bf16", *LOW_PRECISION)  # the precisions that run under Megatron-Core's bf16 (and --bf16)
DEFAULT_RECIPE = {FP8: "delayed", FP4: "nvfp4"}  # TransformerConfig's defaults (fp8_recipe, fp4_recipe)
# Megatron-Core's TransformerConfig.fp8: 'hybrid' is E4M3 forward and E5M2 gradients (Megatron-Bridge's recipes);
# TransformerConfig.fp4: 'e2m1', the one fp4 format
FORMAT = {FP8: "hybrid", FP4: "e2m1"}


# Accelerate 1.15's FP8 under HF Trainer (accelerate.yaml `mixed_precision: fp8` and its `fp8_config`, the keys
# `accelerate launch` turns into the ACCELERATE_FP8_* variables TERecipeKwargs / AORecipeKwargs read;
# accelerate/utils/dataclasses.py): Transformer Engine's DelayedScaling (TERecipeKwargs' default) and MXFP8BlockScaling
# (use_mxfp8_block_scaling), torchao's Float8LinearConfig (its default: dynamic tensorwise scaling). Accelerate has no
# blockwise recipe, and none for fp4.
ACCELERATE_FP8: dict[str, dict] = {
    "delayed": {"backend": "TE", "fp8_format": "HYBRID"},
    "mxfp8": {"backend": "TE", "fp8_format": "HYBRID", "use_mxfp8_block_scaling": True},
    "tensorwise": {"backend": "AO"},
}


def accelerate_fp8_config(plan) -> dict | None:
    """accelerate.yaml's fp8_config of an fp8 plan under HF Trainer (None for other precisions)."""
    if plan.precision != FP8:
        return None
    return dict(ACCELERATE_FP8[plan.fp8_recipe or DEFAULT_RECIPE[FP8]])


def check_accelerate(plan) -> None:
    """What Accelerate's FP8 can train, in one line: fp8 with a recipe ACCELERATE_FP8 has, no fp4."""
    if plan.precision == FP4:
        raise UserInputError("--precision", "Accelerate has no fp4 recipe; fp4 trains with --backend megatron")
    recipe = plan_recipe(plan)
    if recipe is not None and recipe.name not in ACCELERATE_FP8:
        raise UserInputError("--fp8-recipe", f"Accelerate's FP8 has no {recipe.name} recipe; use one of "
                                             f"{', '.join(ACCELERATE_FP8)} or --backend megatron")


@dataclass(frozen=True)
class QuantRecipe:
    """One Transformer Engine recipe: the bytes of what it stores, and the peak its GEMMs run at."""

    name: str
    precision: str  # fp8 | fp4
    element_bytes: float  # one quantized element
    activation_scale_bytes: float  # scale bytes per element of a saved GEMM input
    weight_scale_bytes: float  # scale bytes per element of a quantized weight, in one usage
    peak_keys: tuple[str, ...]  # the catalogue's peak_tflops keys its GEMMs run at, the first the part lists
    # the oldest Transformer Engine Megatron-Core 0.16.1 builds the recipe with (fp8_utils.get_fp8_recipe: 2.1.0 for
    # delayed and mxfp8, 2.2.0.dev0 tensorwise, 2.3.0.dev0 blockwise; fp4_utils.get_fp4_recipe: 2.7.0.dev0 nvfp4)
    te_version: str = "2.1.0"

    @property
    def saved_input_bytes(self) -> float:
        """Bytes per element of a GEMM input saved for backward: the column-wise usage only, with its scales."""
        return self.element_bytes + self.activation_scale_bytes

    @property
    def weight_copy_bytes(self) -> float:
        """Bytes per GEMM weight of its quantized copy: row- and column-wise usages, each with its scales."""
        return 2 * (self.element_bytes + self.weight_scale_bytes)


RECIPES: dict[str, QuantRecipe] = {recipe.name: recipe for recipe in (
    # one fp32 scale (and amax history) per tensor: nothing per element
    QuantRecipe("delayed", FP8, 1.0, 0.0, 0.0, ("fp8",), "2.1.0"),
    QuantRecipe("tensorwise", FP8, 1.0, 0.0, 0.0, ("fp8",), "2.2.0.dev0"),
    # Float8BlockScaling: 1 x 128 blocks of activations, 128 x 128 blocks of weights, fp32 scales
    QuantRecipe("blockwise", FP8, 1.0, 4 / 128, 4 / (128 * 128), ("fp8",), "2.3.0.dev0"),
    # MXFP8BlockScaling: one E8M0 byte per 32 consecutive elements, in each layout
    QuantRecipe("mxfp8", FP8, 1.0, 1 / 32, 1 / 32, ("mxfp8", "fp8"), "2.1.0"),
    # NVFP4BlockScaling: two E2M1 values a byte, one E4M3 scale per 16 elements (and one fp32 per tensor)
    QuantRecipe("nvfp4", FP4, 0.5, 1 / 16, 1 / 16, ("nvfp4",), "2.7.0.dev0"),
)}


def plan_recipe(plan) -> QuantRecipe | None:
    """The recipe a plan's GEMMs run in; None for bf16, fp16 and fp32 plans."""
    if plan.precision == FP8:
        return RECIPES[plan.fp8_recipe or DEFAULT_RECIPE[FP8]]
    if plan.precision == FP4:
        return RECIPES[plan.fp4_recipe or DEFAULT_RECIPE[FP4]]
    return None


def gemm_peak_key(plan, gpu: GPU) -> str | None:
    """The peak_tflops key the plan's GEMMs run at on a GPU: its recipe's, where the part lists it; None for 16- and
    32-bit plans (their precision's key, spec/cluster.py peak_key). A part that lists none of the recipe's peaks is
    refused in one line: pricing its GEMMs at another precision's rate would be a silent guess."""
    recipe = plan_recipe(plan)
    if recipe is None:
        return None
    key = next((key for key in recipe.peak_keys if key in gpu.peak_tflops), None)
    if key is None and not gpu.host:
        raise UserInputError("--fp4-recipe" if recipe.precision == FP4 else "--fp8-recipe",
                             f"{gpu.name}'s catalogue entry has no dense {' or '.join(recipe.peak_keys)} peak for "
                             f"{recipe.name}'s GEMMs (toolkit/presets/gpus.yaml peak_tflops)")
    return key or recipe.peak_keys[-1]


def refuse_on_cpu(precision: str) -> None:
    """CPU ranks (gloo) have no Transformer Engine kernels: an fp8 / fp4 plan stops before anything is written."""
    if precision in LOW_PRECISION:
        raise UserInputError("--precision", f"{precision} runs CUDA kernels (Transformer Engine's, torchao's); CPU "
                                            f"ranks train in bf16, fp16 or fp32")


def check_on_gpu(plan, gpu: GPU) -> None:
    """Transformer Engine's own checks of a recipe against the GPU (quantization.py check_recipe_support:
    _compute_fp8_support, _compute_fp8_block_scaling_support, _compute_mxfp8_support, _compute_nvfp4_support), in one
    line naming the option."""
    recipe = plan_recipe(plan)
    if recipe is None:
        return
    if gpu.host:
        refuse_on_cpu(plan.precision)
    flag = "--fp4-recipe" if recipe.precision == FP4 else "--fp8-recipe"
    cc = capability(gpu)
    arch = f"compute capability {gpu.compute_capability}" if cc else \
        f"{'an' if gpu.vendor[:1].lower() in 'aeiou' else 'a'} {gpu.vendor} part"
    if "fp8" not in gpu.peak_tflops:
        raise UserInputError("--precision", f"{plan.precision} needs fp8 tensor cores (compute capability 8.9 or "
                                            f"higher); {gpu.name} has none")
    if recipe.name == "blockwise" and (cc is None or cc < (9, 0)):
        raise UserInputError(flag, f"blockwise needs Transformer Engine's block-scaled GEMM (compute capability 9.0 "
                                   f"or higher); {gpu.name} is {arch}: use delayed or tensorwise")
    if recipe.name == "mxfp8" and not (cc is None and "mxfp8" in gpu.peak_tflops or cc and (10, 0) <= cc < (12, 0)):
        raise UserInputError(flag, f"mxfp8 is Blackwell's (compute capability 10.x); {gpu.name} is {arch}: use "
                                   f"{'blockwise, ' if cc and cc >= (9, 0) else ''}delayed or tensorwise")
    if recipe.name == "nvfp4" and (cc is None or cc < (10, 0)):
        raise UserInputError(flag, f"nvfp4 is Blackwell's (compute capability 10.0 or higher); {gpu.name} is {arch}: "
                                   f"use --precision fp8")
    gemm_peak_key(plan, gpu)  # a part without the recipe's peak is refused here, before any figure
