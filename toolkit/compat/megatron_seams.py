"""Megatron-Core's seams outside the CPU layer: two fixes of 0.16 as shipped, each applied only where it is needed
(the MoE router without Transformer Engine; the distributed optimizer's load with torch's AdamW), each undone or
harmless where it is not needed; the local spec where neither Transformer Engine nor Apex is, on a CPU or a GPU
(MLA's core attention; torch norms under sequence parallelism); and ChainedOptimizer.step's order, replicated with
the guard's verdict between the gradient norm and the update."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from toolkit.compat import Seam

_DISTRIB = "megatron.core.optimizer.distrib_optimizer"
SEAMS = [
    Seam("megatron-core", "megatron.core.transformer.moe.moe_utils.HAVE_TE",
         "whether moe_utils imported Transformer Engine's te_general_gemm (moe_without_transformer_engine)"),
    Seam("megatron-core", "megatron.core.transformer.moe.moe_utils.te_general_gemm", kind="in_source",
         why="the router tests `te_general_gemm is not None`, a global moe_utils defines only when Transformer "
             "Engine imports: defined as None without it (NameError otherwise)"),
    Seam("megatron-core", "megatron.core.transformer.multi_latent_attention.HAVE_TE",
         "set False where Transformer Engine is missing (mla_without_transformer_engine): 0.16.1's MLA module reads TE "
         "through megatron.core.extensions.transformer_engine, which imports without TE and leaves TELinear a "
         "MagicMock, so the module says HAVE_TE and MLASelfAttention's isinstance(linear_proj, TELinear) raises"),
    Seam("megatron-core", "megatron.core.transformer.dot_product_attention.DotProductAttention.__init__",
         "subclassed by the local spec's MLA core attention (local_mla_core_attention), which takes MLASelfAttention's "
         "k_channels/v_channels keywords and hands the rest on by name",
         parameters=("self", "config", "layer_number", "attn_mask_type", "attention_type", "attention_dropout",
                     "softmax_scale", "cp_comm_type", "pg_collection")),
    Seam("megatron-core", "megatron.core.transformer.torch_norm.WrappedTorchNorm",
         "the local spec's norm, which asserts `not config.sequence_parallel`: sequence_parallel_spec puts "
         "SequenceParallelTorchNorm, built with the same arguments, in its place (layers, q/k norms, final norm)",
         parameters=("config", "hidden_size", "eps", "persist_layer_norm", "zero_centered_gamma", "normalization")),
    Seam("megatron-core", f"{_DISTRIB}.HAVE_APEX_OR_TE",
         "the distributed optimizer runs torch's AdamW (the load fix below) only without Apex and Transformer Engine"),
    Seam("megatron-core", f"{_DISTRIB}.DistributedOptimizer._set_main_param_and_optimizer_states",
         "wrapped on the optimizer instance during a load, to hand through the Adam `step` restored from the param "
         "groups, which a fully_reshardable checkpoint leaves out and a dp_reshardable one gives as the fresh "
         "optimizer's 0 (torch_adam_distributed_load); no public hook runs per parameter there"),
    Seam("megatron-core", "megatron.core.optimizer.optimizer.ChainedOptimizer.step",
         "replicated by chained_step (from megatron-core 0.16.1) through its public parts, with the guard's verdict "
         "between the gradient norm and the update: step() has no hook there. A change of its code (the digest) "
         "means the replica must be compared with it again",
         source_sha256="db95dd373681606be09ac0d5e0fae651a668ef3aa3923705035051b3ce2348bb"),
    *(Seam("megatron-core", f"megatron.core.optimizer.optimizer.MegatronOptimizer.{name}",
           "a public part of ChainedOptimizer.step that chained_step calls as step() does") for name in (
        "prepare_grads", "get_grad_norm", "get_parameters", "step_with_ready_grads")),
    Seam("megatron-core", "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
         "the clipping ChainedOptimizer.step applies per optimizer, called by chained_step with its keywords",
         parameters=("parameters", "max_norm", "total_norm", "use_decoupled_grad")),
    Seam("megatron-core", "megatron.core.transformer.transformer_config.is_te_min_version",
         "TransformerConfig.__post_init__ compares Transformer Engine's version for MoE fp8 (and a few options) "
         "through this name, which raises TypeError without TE (None >= Version): answered for a stated version "
         "while `dmt validate` constructs the config on a machine without TE (te_version_assumed)",
         parameters=("version", "check_equality")),
    Seam("megatron-core", "megatron.core.transformer.transformer_config.get_te_version",
         "named in the same checks' messages: answers the assumed version beside is_te_min_version"),
]


def moe_without_transformer_engine() -> None:
    """Megatron-Core 0.16.1's MoE router tests `te_general_gemm is not None`, a name its moe_utils only defines when
    Transformer Engine imports: without TE (the local spec, CPU) that test raises NameError. Define the name as
    absent, which is what the test means (and what moe_utils would say, so it is left in place)."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def mla_without_transformer_engine() -> None:
    """Megatron-Core 0.16.1's multi_latent_attention imports TELinear from megatron.core.extensions.transformer_engine,
    which imports without Transformer Engine (its TE names are MagicMocks), so the module's HAVE_TE is True there and
    MLASelfAttention's `isinstance(self.linear_proj, TELinear)` raises TypeError. Say what is true: no TE."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def local_mla_core_attention():
    """The local spec's core attention (DotProductAttention) as MLASelfAttention builds it: MLA passes k_channels (the
    query/key head width, nope + rope) and v_channels, which 0.16.1's DotProductAttention does not take. Its scores
    read the query/key width from the tensors and MLA hands it its own softmax_scale; only the context's width comes
    from the config (kv_channels x heads), so the config's kv_channels must be v_channels (the builder sets it)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLACoreAttention(DotProductAttention):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
            if v_channels is not None and v_channels != config.kv_channels:
                raise ValueError(f"the local MLA core attention writes kv_channels ({config.kv_channels}) per head; "
                                 f"v_head_dim is {v_channels}")
            super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                             attention_type=attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)

    return LocalMLACoreAttention


class SequenceParallelTorchNorm:
    """WrappedTorchNorm's torch LayerNorm or RMSNorm, also under sequence parallelism: what Apex's FusedLayerNorm and
    Transformer Engine's norms do beyond their kernels there is mark their weights `sequence_parallel`, which
    finalize_model_grads (_allreduce_non_tensor_model_parallel_grads) then sums over the TP group, as each TP rank
    normalised only its own slice of the sequence. The same arguments as WrappedTorchNorm (a Seam)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        import torch

        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("torch's norms have no zero-centred gamma, persistent or memory-efficient variant "
                             "(Megatron-Core's WrappedTorchNorm asserts the same)")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"torch norms under sequence parallelism: LayerNorm or RMSNorm, not {config.normalization}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def sequence_parallel_spec(spec, layers: int):
    """The local `spec` (a layer's ModuleSpec, made a block of `layers` such layers, a TransformerBlockSubmodules, or
    a multi-token prediction block's) with its torch norms (WrappedTorchNorm, which Megatron-Core picks without
    Transformer Engine and Apex) made SequenceParallelTorchNorm, the block's final norm too; every other module stays
    as it was."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def swap(value):
        if value is WrappedTorchNorm:
            return SequenceParallelTorchNorm
        if isinstance(value, list):
            return [swap(item) for item in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: swap(getattr(value, f.name)) for f in dataclasses.fields(value)
                                                 if f.init})
        return value

    if isinstance(spec, ModuleSpec):  # the final norm of the layers' kind (Apex's FusedLayerNorm stays)
        spec = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=spec.submodules.input_layernorm)
    return swap(spec)


@contextlib.contextmanager
def te_version_assumed(version: str | None):
    """While a TransformerConfig is constructed without Transformer Engine installed (`dmt validate` on a CPU
    machine), its version checks answer as if TE `version` were installed; where TE is installed, or `version` is
    None, nothing changes. Megatron-Core 0.16.1's __post_init__ calls is_te_min_version for MoE fp8 (1.7.0.dev0,
    1.11.0 with grouped GEMM) and compares None with a Version without TE: a TypeError, not a verdict."""
    from megatron.core import utils
    from megatron.core.transformer import transformer_config
    from packaging.version import Version

    if version is None or utils.get_te_version() is not None:
        yield
        return
    assumed = Version(version)

    def is_te_min_version(version, check_equality=True):
        return assumed >= Version(version) if check_equality else assumed > Version(version)

    saved = transformer_config.is_te_min_version, transformer_config.get_te_version
    transformer_config.is_te_min_version, transformer_config.get_te_version = is_te_min_version, lambda: assumed
    try:
        yield
    finally:
        transformer_config.is_te_min_version, transformer_config.get_te_version = saved


def _torch_adam_inners(optimizer) -> list:
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    return [inner for inner in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(inner, distrib_optimizer.DistributedOptimizer) and inner.optimizer is not None]


@contextlib.contextmanager
def torch_adam_distributed_load(optimizer):
    """Megatron-Core 0.16's distributed optimizer with torch's AdamW (no Apex/TE, e.g. on CPU) does not load a
    fully_reshardable state correctly as shipped: (1) building the loading state dict reads Adam's per-parameter
    `step`, which a fresh optimizer does not have yet, so it is initialised here the way torch's first step would
    (zero moments, step 0) before the checkpoint overwrites it; (2) the copy into each parameter's state expects a
    `step` the checkpoint leaves out (it is restored from the param groups), so the restored step is handed through
    (a dp_reshardable checkpoint hands it the loading state dict's own step instead, a LocalNonpersistentObject: the
    fresh optimizer's 0, which would overwrite the restored step; the restored one is handed through there too);
    (3) that restored step is one tensor shared by every parameter, which torch's foreach AdamW would then advance
    once per parameter per step: each parameter gets its own copy after loading. The wrapper is removed whether the
    load succeeds or not; the per-parameter copies only follow a load that finished."""
    import torch

    inners = _torch_adam_inners(optimizer)
    for inner in inners:
        if not inner.optimizer.state:
            inner.init_state_fn(inner.optimizer, inner.config)
            for state in inner.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
    try:
        for inner in inners:
            original = inner._set_main_param_and_optimizer_states

            def with_step(model_param, tensors, inner=inner, original=original):
                group, order = inner.model_param_group_index_map[model_param]
                state = inner.optimizer.state[inner.optimizer.param_groups[group]["params"][order]]
                if "step" in state:
                    tensors = {**tensors, "step": state["step"]}
                return original(model_param, tensors)

            inner._set_main_param_and_optimizer_states = with_step
        yield
        for inner in inners:
            for state in inner.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()
    finally:
        for inner in inners:  # back to the class's method
            inner.__dict__.pop("_set_main_param_and_optimizer_states", None)


def chained_step(optimizer, read_norm: Callable[[object], float], proceed: Callable[[float], bool],
                 before_update: Callable[[], None]) -> tuple[float, bool]:
    """Megatron-Core's optimizer step as ChainedOptimizer.step of 0.16.1 runs it (main gradients prepared, one global
    norm, each optimizer's gradients clipped by it, the update), with `proceed(grad_norm)` asked between the norm and
    the clipping: the update runs only if it says so, after `before_update()`. The norm is get_grad_norm's as
    `read_norm` reads it on the host, or inf where prepare_grads found a non-finite gradient (fp16's grad scaler;
    step() returns before the norm there). Left out of step(): the count of zero gradients (log_num_zeros_in_grad),
    which the toolkit does not log. Returns (norm, updated)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = optimizer.prepare_grads()
    grad_norm = float("inf") if found_inf else read_norm(optimizer.get_grad_norm())
    if not proceed(grad_norm):
        return grad_norm, False
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        parameters = [] if getattr(inner, "is_stub_optimizer", False) else inner.get_parameters()
        if parameters and inner.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(parameters, max_norm=inner.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    before_update()
    optimizer.step_with_ready_grads()
    return grad_norm, True
