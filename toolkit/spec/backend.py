"""What a training backend is: its declaration, and the interface of each of its parts as `typing.Protocol`s.

A backend is a package `toolkit/backends/<name>/` with one module per part, under the same names in every backend
(torchtitan's `protocols/train_spec.py` is the model):

- `rules` (spec): the rules a plan of this backend obeys, the wording when another backend's option is set, the
  defaults it derives when a plan is resolved;
- `search` (planner): the layouts and recompute choices the plan search walks, and its label in the ranked table;
- `memory` / `timing` / `explain` (estimate): its memory and step-time terms and what `--explain` says of them;
- `generate` / `validate`: the files `dmt generate` writes for it and what `dmt validate` reads back;
- `train` (run time): its training loop, which `toolkit/train.py` calls;
- `checkpoint`: its checkpoint format, what `dmt ckpt verify|inspect` detect, check and describe, and the
  conversion `dmt convert <conversion>` runs.

The rest of the toolkit reaches a part as an attribute of the backend's declaration (`backend_of(plan).memory`), typed
by the part's Protocol below, so an editor follows every call to its contract; the part's module is imported on first
use, so that the spec layer holds the registry (`toolkit.spec.backends`) without importing any backend or library.
A backend with nothing to say for a function hook sets it to None (documented per hook). Values of the layers above
the spec (which it may not import) are typed `Any` under their own names, with the module that defines them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # the spec's own types
    from toolkit.spec.cluster import GPU, Network
    from toolkit.spec.model import ModelSpec
    from toolkit.spec.plan import Plan
    from toolkit.spec.recipe import Recipe

StageParams = Any  # toolkit.estimate.memory.StageParams: one pipeline stage's parameter counts
ModelStates = Any  # (weights, gradients, optimizer, buffers, host): toolkit.estimate.memory.ModelStates
ExecutionPath = Any  # toolkit.estimate.efficiency.ExecutionPath: the kernels a step runs
GenerationContext = Any  # toolkit.generate.files.GenerationContext: what every file writer is handed
VerifyReport = Any  # toolkit.checkpoint.verify's VerifyReport, which a checkpoint part adds its findings to
TrainerHooks = Any  # toolkit.backends.hf_hooks.TrainerHooks: what DeepSpeed or FSDP2 adds to the HF Trainer
Problem = Any  # toolkit.validate.Problem: one finding of `dmt validate`
TrainContext = Any  # toolkit.backends.context.TrainContext: what train.py hands a backend's training


@runtime_checkable
class RulesPart(Protocol):
    FOREIGN: Mapping[str, str]  # another backend's option set on this backend's plan -> the one-line refusal
    FINETUNE_REFUSED: Mapping[str, str]  # fine-tuning method this backend cannot train -> why
    EP_REFUSAL: str | None  # why this backend trains no expert parallelism, in one line (None: it does)

    def check(self, p: Plan) -> None: """Refuse (UserInputError naming the key) a plan this backend cannot run."""
    def fill(self, values: dict) -> None: """Derive this backend's defaults into a plan's values being resolved."""
    def check_steps(self, steps: int, warmup: int, key: str) -> None: """Refuse a step count it cannot train."""


@runtime_checkable
class SearchPart(Protocol):
    def layouts(self, model, gpus: int, nvlink_domain: int, fixed: dict, axis) -> Iterator[dict]:
        """Every parallel layout of this backend for the world, the options fixed by the user held; `nvlink_domain`:
        the GPUs of one NVLink fabric (a node, or an NVL72 rack), where tensor parallelism and sharding groups stay."""
    def recompute_options(self) -> list[dict]: """The recompute choices the search tries."""
    def label(self, plan) -> list[str]: """Its words in the ranked table's plan column."""
    def sharding_text(self, plan) -> str: """How its states are sharded, for the CLI's plan line."""


@runtime_checkable
class MemoryPart(Protocol):
    def padded_vocab(self, vocab_size: int, tp: int) -> int: """The embedding rows it allocates."""
    def model_states(self, spec: ModelSpec, plan: Plan, params: StageParams, layer_params: int) -> ModelStates:
        """Weights, gradients, optimizer states, buffers and host bytes of one rank."""
    def step_fp32_grads(self, spec: ModelSpec, plan: Plan, params: StageParams) -> int:
        """The fp32 gradients alive inside optimizer.step()."""
    def saved_bytes_per_param(self, plan: Plan) -> int: """What a checkpoint writes per trained parameter."""
    def alive_at_backward_start(self, plan: Plan, gradients: int, buffers: dict[str, int]) -> int:
        """Its states alive when the last stage's backward starts, beside weights and optimizer."""


@runtime_checkable
class TimingPart(Protocol):
    def execution_path(self, plan: Plan) -> ExecutionPath: """The kernels and overlap its steps run with."""
    def data_parallel_and_optimizer(self, spec: ModelSpec, plan: Plan, gpu: GPU, network: Network,
                                    compute_micro: float, params_total: int, trainable: int
                                    ) -> tuple[float, float, float]:
        """Seconds of exposed data-parallel communication, optimizer step and offload per step."""


@runtime_checkable
class ExplainPart(Protocol):
    def one_replica(self, plan: Plan) -> dict: """The plan's options on one unsharded replica."""
    def sharding(self, plan: Plan) -> str: """How it shards the model states, in words."""
    def weights(self, plan: Plan) -> tuple[str | None, str | None]: """Its weights' rule and rule of thumb."""
    def gradients(self, plan: Plan) -> tuple[str, str]: """Its gradients' rule and rule of thumb."""
    def optimizer_offloaded(self, plan: Plan) -> str | None: """Where its optimizer states went, if offloaded."""
    def master_copy(self, plan: Plan) -> str | None: """Its fp32 master weights, where it keeps them apart."""
    def fp32_gradients(self, plan: Plan) -> str: """Its fp32 gradients inside the step."""


@runtime_checkable
class GeneratePart(Protocol):
    WRITERS: Mapping[str, Callable[[GenerationContext], str]]  # file name -> its text, beyond the common files
    # TrainingArguments it adds to trainer_args.json (FSDP2's plugin); None where it trains no HF Trainer
    trainer_extras: Callable[[Recipe, Plan], dict] | None

    def launch_variables(self, plan: Plan) -> dict[str, tuple[str, str]]:
        """Environment variables launch.sh exports for it: name -> (value, reason)."""


@runtime_checkable
class ValidatePart(Protocol):
    READERS: Mapping[str, tuple[str, Callable]]  # generated file its training reads -> (record key, reader)
    # `accelerate launch`'s checks of accelerate.yaml for it; None where it is not launched by accelerate
    accelerate_launch: Callable[..., list[Problem]] | None


@runtime_checkable
class TrainPart(Protocol):
    TRAINER_HOOKS: TrainerHooks | None  # what it adds to the HF Trainer; None where it trains Megatron-Core's modules

    def train(self, context: TrainContext) -> dict:
        """train.py's entry: trains the generated files of the launch `context` names; the run's summary."""


@runtime_checkable
class CheckpointPart(Protocol):
    FORMATS: tuple[str, ...]  # the format names `dmt ckpt` prints for its checkpoints
    MANIFEST_FORMAT: str  # the manifest's `format` of the checkpoints its training saves
    TO_HF: HFConversion  # what `dmt convert <Backend.conversion>` offers

    def detect(self, path: Path) -> str | None: """Its format's name if the directory is one of its checkpoints."""
    def verify(self, path: Path, report: VerifyReport, deep: bool) -> None: """Add its findings to the report."""
    def inspect(self, path: Path) -> dict: """What `dmt ckpt inspect` says of it."""
    to_hf: Callable[..., dict]  # the conversion to an HF model: (ckpt_dir, out_dir, dtype, max_shard_size, config,
    #                             progress, **flags) -> its JSON summary


PARTS: dict[str, type] = {"rules": RulesPart, "search": SearchPart, "memory": MemoryPart, "timing": TimingPart,
                          "explain": ExplainPart, "generate": GeneratePart, "validate": ValidatePart,
                          "train": TrainPart, "checkpoint": CheckpointPart}


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


@dataclass(frozen=True)
class Backend:
    """A training backend as data, the way families/ declares a model family, and its parts as typed attributes."""

    name: str  # the plan's `backend` value, the `--backend` choice and its package toolkit/backends/<name>/
    label: str  # the library as its users name it, for messages
    hf_modules: bool  # trains the HF model's own modules through the HF Trainer (else Megatron-Core's modules)
    default_zero: int  # the plan's `zero` when not given (DeepSpeed's ZeRO stage; 0 for the others)
    launchers: tuple[str, ...]  # the launchers `dmt generate` writes commands for, the first one the default
    conversion: str | None  # the `dmt convert` subcommand that turns its checkpoint into an HF model (None: it is one)
    files: tuple[str, ...] = field(default=())  # the files `dmt generate` writes for it beyond the common ones
    article: str = "a"  # before its label, as in "is an FSDP2 option"
    async_save: bool = False  # can write checkpoints in the background (training.async_save)
    in_process_restart: bool = False  # its training function restarts inside NVRx's in-process Wrapper (docs/faults.md)
    in_process_refused: str = ""  # where it cannot: why (training.restart's refusal line)
    # its state goes to NVRx's LocalCheckpointManager as a TensorAwareStateDict (checkpoint.local, docs/faults.md)
    local_checkpoints: bool = False

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

    def _module(self, part: str):
        """The part's module, imported on first use (the one place a part is named by string)."""
        name = f"toolkit.backends.{self.name}.{part}"
        return sys.modules.get(name) or importlib.import_module(name)  # the planner asks per candidate

    @property
    def rules(self) -> RulesPart:
        return self._module("rules")

    @property
    def search(self) -> SearchPart:
        return self._module("search")

    @property
    def memory(self) -> MemoryPart:
        return self._module("memory")

    @property
    def timing(self) -> TimingPart:
        return self._module("timing")

    @property
    def explain(self) -> ExplainPart:
        return self._module("explain")

    @property
    def generate(self) -> GeneratePart:
        return self._module("generate")

    @property
    def validate(self) -> ValidatePart:
        return self._module("validate")

    @property
    def train(self) -> TrainPart:
        return self._module("train")

    @property
    def checkpoint(self) -> CheckpointPart:
        return self._module("checkpoint")
