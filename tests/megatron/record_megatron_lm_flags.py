"""Record Megatron-LM's pretrain_gpt.py flags from its real parser, and check argument files against its real
validate_args, at the Megatron-LM tag that matches the pinned Megatron-Core (core_v0.16.1 for megatron-core 0.16.1).

Megatron-LM's training package is not on PyPI, so the suite cannot import its parser: it checks every generated
megatron_args.txt against the table this writes (megatron_lm_flags.txt: each flag, its type, nargs and choices),
and against the validate_args asserts recorded in test_megatron_generate.py. Refresh both when the pin moves:

  git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.16.1
  .venv/bin/pip install six                  # the one extra import of megatron.training's tokenizer module
  .venv/bin/python tests/megatron/record_megatron_lm_flags.py Megatron-LM > tests/megatron/megatron_lm_flags.txt
  .venv/bin/python tests/megatron/record_megatron_lm_flags.py Megatron-LM --check megatron_configs/*.args.txt

The parser is built as Megatron-LM builds it (add_megatron_arguments over the installed Megatron-Core's config
classes); its one GPU-only import (batch-invariant Triton kernels, unused by the parser) is stood in for. --check
runs parse_args and validate_args on a Hopper (compute capability 9.0) with CUDA_DEVICE_MAX_CONNECTIONS=1, as the
toolkit's launch files set it, adding the data and tokenizer flags megatron_args.txt leaves to the user, then builds
the config class as pretrain_gpt.py does (core_transformer_config_from_args: MLATransformerConfig for
--multi-latent-attention), Transformer Engine's version checks answering as the newest TE a recipe needs.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import shlex
import sys
import types
from pathlib import Path

GPU_ONLY = ("megatron.core.transformer.custom_layers.batch_invariant_kernels",)
USER_FLAGS = ["--data-path", "/data/corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256"]


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in GPU_ONLY else None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        pass


def megatron_lm_parser(checkout: Path) -> argparse.ArgumentParser:
    sys.meta_path.insert(0, _StandInFinder())
    sys.path.append(str(checkout))  # megatron is a namespace package: megatron.training joins the installed core
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def kind(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    name = getattr(action.type, "__name__", None) or "str"
    text = name + (action.nargs if action.nargs in ("*", "+", "?") else "")
    return text + ("{" + ",".join(str(c) for c in action.choices) + "}" if action.choices else "")


def record(checkout: Path) -> None:
    parser = megatron_lm_parser(checkout)
    print("# Megatron-LM's pretrain_gpt.py flags at tag core_v0.16.1 (the real parser, by record_megatron_lm_flags.py):")
    print("# flag and kind: switch, or the type's name (int, float, str, ...), with ? * + for nargs and {a,b} choices.")
    for action in sorted(parser._actions, key=lambda a: a.option_strings[0] if a.option_strings else ""):
        for flag in action.option_strings:
            if flag.startswith("--"):
                print(f"{flag} {kind(action)}")


def check(checkout: Path, files: list[str]) -> int:
    import torch
    import yaml

    parser = megatron_lm_parser(checkout)
    import megatron.training.arguments as arguments
    from packaging.version import Version

    from toolkit.compat.megatron_seams import te_version_assumed
    from toolkit.spec.quantization import RECIPES

    newest_te = max((recipe.te_version for recipe in RECIPES.values()), key=Version)  # one that runs every recipe

    arguments.get_device_arch_version = lambda: 9
    torch.cuda.get_device_capability = lambda *args: (9, 0)
    failures = 0
    for name in files:
        words = [w for line in Path(name).read_text().splitlines() if line.strip() and not line.startswith("#")
                 for w in shlex.split(line)] + USER_FLAGS
        world = yaml.safe_load(Path(name.replace(".args.txt", ".yaml")).read_text())["schedule"]["world_size"]
        os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
        try:
            args = parser.parse_args(words)
            args.rank, args.world_size = 0, world
            arguments.validate_args(args, {})
            try:
                with te_version_assumed(newest_te):  # the GPU's Transformer Engine, absent here
                    built = f"{type(arguments.core_transformer_config_from_args(args)).__name__} built"
            except ValueError as exc:  # rope fusion's kernels are imported from TE, not version-checked
                if "install TE" not in str(exc):
                    raise
                built = f"its config needs Transformer Engine's kernels here ({exc})"
            print(f"{name}: accepted by parse_args and validate_args, {built}", file=sys.stderr)
        except (SystemExit, AssertionError, ValueError) as exc:
            failures += 1
            print(f"{name}: REJECTED ({type(exc).__name__}: {exc})", file=sys.stderr)
    return 1 if failures else 0


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("checkout", type=Path, help="a Megatron-LM checkout at the matching tag")
    cli.add_argument("--check", nargs="+", metavar="ARGS_TXT", help="megatron_args.txt files (beside their .yaml)")
    options = cli.parse_args()
    if options.check:
        return check(options.checkout, options.check)
    record(options.checkout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
