"""megatron.yaml's fields against what their owners declare: the type Megatron-Core's classes annotate for each field
(TransformerConfig, GPTModel, DistributedDataParallelConfig, OptimizerConfig, OptimizerParamScheduler), the fields
they cannot do without, and the toolkit's own schedule and model sections; pydantic's TypeAdapter checks each value
against its annotation. A wrong or missing value is named before any arithmetic or library class trips over it."""

from __future__ import annotations

import functools
import json
import re
import typing
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from toolkit.generate.megatron import DTYPE_FIELDS, DTYPE_NAMES, transformer_config_class
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
# annotated int, but None is meaningful to Megatron-Core: MLASelfAttention projects the queries directly when
# q_lora_rank is None (DeepSeek-V2-Lite, the tiny test models; Megatron-LM's --q-lora-rank defaults to None)
NONE_MEANS = {(TC, "q_lora_rank")}


def _owners(config: dict) -> dict[str, tuple[dict[str, Any], set[str]]]:
    """Section -> (field -> annotated type, fields without a default) of the Megatron-Core class it feeds
    (MLATransformerConfig for a transformer_config with multi-latent attention: transformer_config_class)."""
    import dataclasses
    import inspect

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def hints(owner) -> dict[str, Any]:
        # a name the owner imports only for type checkers (MegatronOptimizer) stands for Any, so that one forward
        # reference does not hide the other annotations; that field is left to the class itself
        unresolved: dict[str, Any] = {}
        while True:
            try:
                found = typing.get_type_hints(owner, localns=unresolved)
                break
            except NameError as exc:
                if not exc.name or exc.name in unresolved:
                    raise
                unresolved[exc.name] = Any
        found.pop("return", None)
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
        TC: of_dataclass(transformer_config_class(config[TC])),
        "ddp_config": of_dataclass(DistributedDataParallelConfig),
        "optimizer_config": of_dataclass(OptimizerConfig),
        "gpt_model": of_function(GPTModel.__init__, {"self", "config", "transformer_layer_spec"}),
        "scheduler": of_function(OptimizerParamScheduler.__init__, {"self", "optimizer"}),
        "schedule": (SCHEDULE_TYPES, set()),
        "model": (MODEL_TYPES, set()),
    }


@functools.lru_cache(maxsize=None)
def _adapter(hint) -> TypeAdapter | None:
    """pydantic's validator of the annotation; None where pydantic cannot build one (that field is left to the
    class itself)."""
    try:
        return TypeAdapter(hint, config=ConfigDict(arbitrary_types_allowed=True))
    except Exception:  # pydantic's schema errors and unhashable or odd annotations alike
        return None


def _type_problem(value, hint) -> str | None:
    """Why `value`, as YAML gives it, is not of the annotated type; None where it is or the annotation says too
    little. Validated as JSON in strict mode: YAML's values are JSON's (a list may fill a tuple, an integer a float),
    and nothing is coerced (no "2" for 2, no true for 1)."""
    try:
        adapter = _adapter(hint)
    except TypeError:  # an annotation that cannot be a cache key (unhashable metadata): built for this call alone
        adapter = _adapter.__wrapped__(hint)
    if adapter is None:
        return None
    try:
        adapter.validate_json(json.dumps(value, default=str), strict=True)
    except ValidationError as exc:
        errors = exc.errors()
        if any(e["type"] == "needs_python_object" for e in errors):  # a class only Python code can pass
            return None
        said = "; ".join(dict.fromkeys(e["msg"][0].lower() + e["msg"][1:] for e in errors))
        return f"{value!r} is not {_type_name(hint)}: {said}"
    return None


def _type_name(hint) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return re.sub(r"\b(?:\w+\.)+(?=\w)", "", str(hint))  # typing.Optional[typing.List[str]] -> Optional[List[str]]


def field_problems(config: dict) -> list[Problem]:
    """Missing fields the owners need, then values not of their declared type, each naming `section.field`."""
    problems = []
    for section, (types_of, library_required) in _owners(config).items():
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
            if key in BY_NAME or hint is None or (value is None and (section, key) in NONE_MEANS):
                continue
            said = _type_problem(value, hint)
            if said:
                problems.append(Problem(f"{section}.{key}", said))
    return problems
