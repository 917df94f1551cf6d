"""The plan options as command-line flags, derived from their one declaration (toolkit.spec.options.PlanOptions).

`dmt estimate` and `dmt plan` take them as the plan to estimate or the options to pin; `dmt generate`,
`dmt restore-test` and `toolkit/train.py` as overrides of a recipe's plan. Every flag defaults to None ("not given"),
so resolving the plan fills the declared default, or the recipe's value.
"""

from __future__ import annotations

import argparse
from typing import Annotated, get_args, get_origin

from toolkit.numeric import bounded_int, finite_float
from toolkit.spec.finetune import FINETUNE_NAMES, FinetuneOptions, finetune_flag
from toolkit.spec.options import OPTION_NAMES, PlanOptions, choices, default_text, field_extra, flag

FINETUNE = "finetune"  # plan_overrides' key for the FinetuneOptions fields given on the command line


def _argument(name: str) -> dict:
    """argparse keyword arguments for one option: a switch, a comma list, a choice or a typed value."""
    info = PlanOptions.model_fields[name]
    annotation = info.annotation
    inner = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    kind = inner[0]
    if get_origin(kind) is Annotated:  # PositiveInt: the constraint is checked when the plan resolves
        kind = get_args(kind)[0]
    metavar = field_extra(info, "metavar")
    if kind is bool:  # a switch; one whose default depends on other options can also be turned off (--no-...)
        return {"action": "store_true" if info.default is False else argparse.BooleanOptionalAction}
    if get_origin(kind) is tuple:  # a comma list, split by PlanOptions itself
        return {"type": str, "metavar": metavar or ",".join(choices(name))}
    try:
        values = choices(name)
    except KeyError:
        kind = {float: finite_float, int: bounded_int}.get(kind, kind)
        return {"type": kind, **({"metavar": metavar} if metavar else {})}
    return {"type": type(values[0]), "choices": list(values)}


def add_plan_flags(parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = (), required: tuple[str, ...] = (),
                   overriding: str | None = None) -> None:
    """One flag per plan option. `overriding` names what an absent flag leaves in place ("the recipe's plan")."""
    for name in OPTION_NAMES:
        if name in exclude:
            continue
        info = PlanOptions.model_fields[name]
        when_absent = f"default: {default_text(name)}" if overriding is None else f"overrides {overriding}"
        text = f"{info.description} ({when_absent})".replace("%", "%%")
        parser.add_argument(flag(name), dest=name, default=None, required=name in required, help=text,
                            **_argument(name))
    add_finetune_flags(parser, overriding)


def _finetune_dest(name: str) -> str:
    return finetune_flag(name)[2:].replace("-", "_")  # --lora-r -> lora_r, --finetune -> finetune


def add_finetune_flags(parser: argparse.ArgumentParser, overriding: str | None = None) -> None:
    """One flag per FinetuneOptions field (--finetune, --lora-r, ...); None when not given."""
    for name in FINETUNE_NAMES:
        info = FinetuneOptions.model_fields[name]
        shown = ",".join(info.default) if isinstance(info.default, tuple) else info.default
        when_absent = f"default: {shown}" if overriding is None else f"overrides the recipe's finetune.{name}"
        if name == "method":
            kind: dict = {"choices": list(get_args(info.annotation))}
        elif name == "target_modules":
            kind = {"type": str, "metavar": info.json_schema_extra["metavar"]}
        else:  # the rank is an integer; alpha and dropout may be fractions
            kind = {"type": bounded_int if isinstance(info.default, int) and name == "r" else finite_float}
        parser.add_argument(finetune_flag(name), dest=_finetune_dest(name), default=None,
                            help=f"{info.description} ({when_absent})".replace("%", "%%"), **kind)


def plan_overrides(args: argparse.Namespace) -> dict:
    """The plan options given on the command line (None: not given); the fine-tuning ones as one `finetune` dict."""
    given = {name: getattr(args, name) for name in OPTION_NAMES if getattr(args, name, None) is not None}
    finetune = {name: getattr(args, _finetune_dest(name)) for name in FINETUNE_NAMES
                if getattr(args, _finetune_dest(name), None) is not None}
    return {**given, FINETUNE: finetune} if finetune else given


def option_argv(options: dict) -> list[str]:
    """Plan options back as flags, for a launched process: {"zero": 3, "sequence_parallel": True,
    "reshard_after_forward": False} -> --zero 3 --sequence-parallel --no-reshard-after-forward."""
    argv = []
    for name, value in options.get(FINETUNE, {}).items():
        argv += [finetune_flag(name), ",".join(value) if isinstance(value, (tuple, list)) else str(value)]
    options = {k: v for k, v in options.items() if k != FINETUNE}
    for name, value in options.items():
        if value is False and PlanOptions.model_fields[name].default is None:
            argv.append("--no-" + flag(name)[2:])
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag(name))
        else:
            argv += [flag(name), ",".join(value) if isinstance(value, (tuple, list)) else str(value)]
    return argv
