"""A training backend as data, the way families/ declares a model family: its name, what it trains, how it is
launched and converted, and where its own code lives.

Each backend is a package `toolkit/backends/<name>/` whose `__init__.py` declares `BACKEND` and whose modules hold
that backend's part of each layer, under the same names in every backend:

- `rules.py` (spec): the rules a plan of this backend obeys, the wording when another backend's option is set, and
  the defaults it derives when a plan is resolved;
- `memory.py` / `timing.py` / `explain.py` (estimate): its memory and step-time terms and what `dmt estimate
  --explain` says of them, the same hooks in every backend (tests/unit/test_backend_registry.py HOOKS);
- `checkpoint.py` (checkpoint): its checkpoint format, the same hooks in every backend (tests/unit/
  test_backend_registry.py HOOKS): what `dmt ckpt verify|inspect` detect, check and describe, and the conversion
  `dmt convert <conversion>` runs (declared by an `HFConversion`);
- `train.py` and the modules beside it (run time): its training loop.

The rest of the toolkit reaches a backend's code through `Backend.part(<module>)` and never compares a backend's
name; the registry (`toolkit.backends.BACKENDS`) is the list the planner, generators, validators and train.py walk.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType


@dataclass(frozen=True)
class Backend:
    name: str  # the plan's `backend` value and the `--backend` choice
    label: str  # the library as its users name it, for messages
    hf_modules: bool  # trains the HF model's own modules through the HF Trainer (else Megatron-Core's modules)
    default_zero: int  # the plan's `zero` when not given (DeepSpeed's ZeRO stage; 0 for the others)
    launchers: tuple[str, ...]  # the launchers `dmt generate` writes commands for, the first one the default
    conversion: str | None  # the `dmt convert` subcommand that turns its checkpoint into an HF model (None: it is one)
    files: tuple[str, ...] = field(default=())  # the files `dmt generate` writes for it beyond the common ones
    article: str = "a"  # before its label, as in "is an FSDP2 option"
    async_save: bool = False  # can write checkpoints in the background (training.async_save)

    def saves_async(self, asked: bool | None, accelerator: str = "gpu") -> bool:
        """Whether its checkpoints are written in the background: the recipe's training.async_save where this backend
        can; unset, on GPUs only. On CPU ranks (gloo: the tests and the demo) Megatron-Core's asynchronous path does
        not run as the library ships it (the toolkit copies the tensors while training waits, then writes in a
        spawned writer process), and for the small models trained there the writer costs more than it saves
        (measured: +6 s per launch of the tiny recipe, 17 s against 11 s; FSDP2's writing threads share the same 2
        cores with training): a recipe asks for it there explicitly."""
        if not self.async_save:
            return False
        return asked if asked is not None else accelerator != "cpu"

    def part(self, module: str) -> ModuleType:
        """This backend's module of that name (`rules`, `memory`, `timing`, `train`, ...), imported on first use so
        that the spec layer can hold the registry without importing any library."""
        return importlib.import_module(f"toolkit.backends.{self.name}.{module}")


@dataclass(frozen=True)
class HFConversion:
    """What `dmt convert <Backend.conversion>` offers for a backend's checkpoints (its checkpoint part's `TO_HF`):
    the words of its help, its source argument, the flags beyond those every conversion to HF has (--dtype,
    --max-shard-size, --config, --json), and the line it prints: `line.format(**summary, source=, mib=)` of the JSON
    summary its `to_hf` returns, the checkpoint given and the MiB written."""

    help: str
    description: str
    metavar: str  # the checkpoint argument as the usage line names it
    source_help: str | None
    line: str
    flags: tuple[tuple[str, dict], ...] = ()  # (flag, argparse keywords): handed to `to_hf` by their dest
