"""megatron.yaml's fields against what their owners declare: the type Megatron-Core's classes annotate for each field
(TransformerConfig, GPTModel, DistributedDataParallelConfig, OptimizerConfig, OptimizerParamScheduler), the fields
they cannot do without, and the toolkit's own schedule and model sections. A wrong or missing value is named before
any arithmetic or library class trips over it."""

from __future__ import annotations

import sys
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from toolkit.generate.megatron import DTYPE_FIELDS, DTYPE_NAMES
from toolkit.validate import Problem

TC = "transformer_config"
SCHEDULE_KEYS = ("world_size", "data_parallel_size", "micro_batch_size", "num_microbatches", "global_batch_size",
                 "seq_length", "train_iters", "seed", "async_save")
SCHEDULE_OPTIONAL = ("save_interval",)  # checkpoint every N steps (the recipe's save_steps), absent: only at the end
SCHEDULE_TYPES = {**{key: int for key in SCHEDULE_KEYS + SCHEDULE_OPTIONAL}, "async_save": bool}  # training.async_save
# megatron.yaml's optional `data` section (a blend: toolkit.generate.megatron.data_section)
DATA_KEYS = ("blend", "split", "cache_dir", "num_workers", "reset_position_ids", "reset_attention_mask",
             "eod_mask_loss")
MODEL_TYPES = {"family": str, "vocab_size": int, "make_vocab_size_divisible_by": int, "padded_vocab_size": int}
# what training and the rules below read without a default of their own
TOOLKIT_REQUIRED = {TC: ("num_layers", "hidden_size", "num_attention_heads"), "schedule": SCHEDULE_KEYS,
                    "model": ("family", "vocab_size")}
# stored by name in the file and turned into objects by toolkit.generate.megatron.library_kwargs, or checked by a
# rule of the validator that says more (transformer_impl: the layer specs the toolkit trains)
BY_NAME = {"params_dtype", "pipeline_dtype", "main_params_dtype", "main_grads_dtype", "activation_func",
           "transformer_impl"}


def _owners() -> dict[str, tuple[dict[str, Any], set[str]]]:
    """Section -> (field -> annotated type, fields without a default) of the Megatron-Core class it feeds."""
    import dataclasses
    import inspect

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    def hints(owner) -> dict[str, Any]:
        try:
            return typing.get_type_hints(owner)
        except Exception:  # one forward reference (MegatronOptimizer) must not hide the other annotations
            pass
        namespace = {**vars(typing), **vars(sys.modules[owner.__module__])}
        found = {}
        for name, annotation in getattr(owner, "__annotations__", {}).items():
            try:
                found[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
            except Exception:  # that field is left to the class itself
                continue
        return found

    def of_dataclass(cls):
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        return hints(cls), required

    def of_function(fn, given: set[str]):
        params = inspect.signature(fn).parameters.values()
        required = {p.name for p in params if p.default is inspect.Parameter.empty and p.name not in given}
        return hints(fn), required

    return {
        TC: of_dataclass(TransformerConfig),
        "ddp_config": of_dataclass(DistributedDataParallelConfig),
        "optimizer_config": of_dataclass(OptimizerConfig),
        "gpt_model": of_function(GPTModel.__init__, {"self", "config", "transformer_layer_spec"}),
        "scheduler": of_function(OptimizerParamScheduler.__init__, {"self", "optimizer"}),
        "schedule": (SCHEDULE_TYPES, set()),
        "model": (MODEL_TYPES, set()),
    }


def _accepts(value, hint) -> bool | None:
    """Whether `value`, as YAML gives it, is of the annotated type; None where the annotation says too little."""
    origin = get_origin(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        verdicts = [_accepts(value, arg) for arg in get_args(hint)]
        return True if True in verdicts else None if None in verdicts else False
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    return None


def _describe(hint) -> str:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(hint))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null",
             list: "a list", tuple: "a list", dict: "a mapping"}
    return names.get(hint, names.get(origin, getattr(hint, "__name__", str(hint))))


def field_problems(config: dict) -> list[Problem]:
    """Missing fields the owners need, then values not of their declared type, each naming `section.field`."""
    problems = []
    for section, (types_of, library_required) in _owners().items():
        values = config[section]
        for key in sorted(library_required | set(TOOLKIT_REQUIRED.get(section, ()))):
            if key not in values:
                problems.append(Problem(f"{section}.{key}", "is missing; regenerate with `dmt generate` or add it"))
        for key, value in values.items():
            hint = types_of.get(key)
            if key in DTYPE_FIELDS and value is not None and value not in DTYPE_NAMES:
                problems.append(Problem(f"{section}.{key}", f"{value!r} is not a dtype name; valid: "
                                                            f"{', '.join(DTYPE_NAMES)}"))
                continue
            if key in BY_NAME or hint is None:
                continue
            if _accepts(value, hint) is False:
                problems.append(Problem(f"{section}.{key}", f"{value!r} is not {_describe(hint)}"))
    return problems
