"""`dmt validate FILE --world-size N [--model M] [--trainer-args FILE]`: check a DeepSpeed JSON, an Accelerate FSDP
config (accelerate.yaml), a megatron.yaml (`toolkit.cli.validate_megatron`) or a Kubernetes manifest before
launching."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolkit.backends.deepspeed.rules import check_pipeline as check_deepspeed_pipeline
from toolkit.cli import validate_megatron
from toolkit.cli.paths import path_arg
from toolkit.errors import UserInputError
from toolkit.generate.files import PLAN_FILE
from toolkit.generate.ft_launcher import SECTION as FT_SECTION
from toolkit.generate.k8s.vendored import SCHEMAS, release
from toolkit.numeric import bounded_int, json_text
from toolkit.readers import parse_yaml_documents, read_json, read_text
from toolkit.spec.cluster import DEFAULT_GPU, get_gpu
from toolkit.spec.finetune import FinetuneOptions, finetune_flag
from toolkit.spec.model import load_model_spec
from toolkit.spec.options import choices, default
from toolkit.spec.recipe import Recipe
from toolkit.validate.accelerate_fsdp import validate_accelerate_deepspeed, validate_accelerate_fsdp
from toolkit.validate.deepspeed import finetune_problems, memory_problem, validate_deepspeed_config
from toolkit.validate.generated import read_ft_config, read_generated
from toolkit.validate.k8s.manifests import is_manifest, validate_manifest


def choices_of(annotation) -> list:
    from typing import get_args

    return list(get_args(annotation))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=path_arg, metavar="FILE",
                        help="DeepSpeed JSON (generated or hand-written), accelerate.yaml (FSDP), megatron.yaml, a "
                             "Kubernetes manifest (TrainJob, JobSet, PyTorchJob), or a directory `dmt generate` wrote "
                             "(or its plan.json): every file checked against the plan, learning rate and warm-up "
                             "included")
    parser.add_argument("--world-size", type=bounded_int, default=None,
                        help="processes the job will launch (a Kubernetes manifest: default the plan it records)")
    # not offered: DeepSpeed plans have one pipeline stage; taken only to refuse it in the plans' own words
    parser.add_argument("--pp", type=bounded_int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--trainer-args", type=path_arg, default=None, help="HF TrainingArguments as JSON (trainer_args.json)")
    parser.add_argument("--model", default=None, help="model for the memory-fit estimate (any form --model takes)")
    parser.add_argument("--gpu", default=DEFAULT_GPU, help="GPU for the memory-fit estimate (default %(default)s)")
    parser.add_argument("--seq-len", type=bounded_int, default=default("seq_len"), help="sequence length for the memory-fit "
                                                                               "estimate (default %(default)s)")
    parser.add_argument("--recompute", choices=choices("recompute"), default=None,
                        help="activation checkpointing for the estimate (default: the trainer arguments', else none)")

    method = FinetuneOptions.model_fields["method"]
    parser.add_argument(finetune_flag("method"), dest="finetune", choices=choices_of(method.annotation),
                        default=method.default, help=f"{method.description} (default %(default)s): what the run "
                                                     f"trains, for the rules that depend on it")
    parser.add_argument("--json", action="store_true", help="print one JSON object: ok and the problems")


def _read_json(path: Path, flag: str, what: str):
    return read_json(path, flag, what=what)


def run(args: argparse.Namespace) -> int:
    import logging

    if args.world_size is not None and args.world_size < 1:
        raise UserInputError("--world-size", f"must be positive, got {args.world_size}")
    if args.file.is_dir() or args.file.name == PLAN_FILE:
        return _generated(args)
    if args.file.suffix in (".yaml", ".yml"):  # accelerate.yaml (FSDP), megatron.yaml, or a Kubernetes manifest

        what = "an accelerate.yaml, a megatron.yaml or a Kubernetes manifest"
        documents = parse_yaml_documents(read_text(args.file, "FILE", what, "yaml"), args.file, "FILE", what)
        if is_manifest(documents):  # apiVersion and kind: a TrainJob, a JobSet, a PyTorchJob
            return _manifest(args, documents)
        if len(documents) > 1:
            raise UserInputError("FILE", f"{args.file} holds {len(documents)} YAML documents, not all with apiVersion "
                                         f"and kind; expected {what}")
        config = documents[0]
        if isinstance(config, dict) and FT_SECTION in config:  # ft_config.yaml: NVRx's ft_launcher configuration
            read_ft_config(args.file)  # one UserInputError line on its first problem
            print(json_text({"ok": True, "problems": []}) if args.json
                  else f"{args.file}: valid (NVRx's FaultToleranceConfig, as ft_launcher --ft-cfg-path reads it)")
            return 0
        if _is_recipe(config):  # read as a megatron.yaml it is a page of missing sections
            raise UserInputError("FILE", f"{args.file} is a recipe, not a file `dmt validate` checks ({what}); "
                                         f"`dmt generate {args.file} --out DIR` writes them (and checks them as it "
                                         f"does), then `dmt validate DIR` checks them again")
        _require_world_size(args)
        if "distributed_type" in config:  # Accelerate's own config: its plugin classes and launch-time rules
            if args.world_size < 1:
                raise UserInputError("--world-size", f"must be positive, got {args.world_size}")
            return _accelerate(args, config)

        return validate_megatron.run(args)

    # DeepSpeed's own import-time warnings (which accelerator it picked) are noise here: the problems are the output
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)

    _require_world_size(args)
    for flag, value in (("--world-size", args.world_size), ("--pp", args.pp), ("--seq-len", args.seq_len)):
        if value < 1:
            raise UserInputError(flag, f"must be positive, got {value}")
    check_deepspeed_pipeline(args.pp)
    config = _read_json(args.file, "FILE", "a DeepSpeed config (a JSON object)")
    trainer = _read_json(args.trainer_args, "--trainer-args", "HF TrainingArguments as a JSON object") \
        if args.trainer_args else None
    check = None
    if args.model:
        model, gpu = load_model_spec(args.model), get_gpu(args.gpu)
        checkpointing = isinstance(trainer, dict) and (trainer.get("activation_checkpointing")
                                                       or trainer.get("gradient_checkpointing"))
        recompute = args.recompute or ("full" if checkpointing else "none")

        def check(filled: dict):
            return memory_problem(filled, model, gpu, args.world_size, args.seq_len, recompute)

    problems = validate_deepspeed_config(config, args.world_size, trainer_args=trainer, memory_check=check,
                                         config_path=args.file)
    return print_problems(args, problems + finetune_problems(config, args.finetune))


def _generated(args: argparse.Namespace) -> int:
    """A generated directory, read as train.py --plan reads it (toolkit/validate/generated.py): its plan against the
    recipe, each file against the plan, the learning rate and warm-up against plan.json's lr_scaling; the first
    disagreement is one line (exit 2)."""
    if args.file.is_dir() and not (args.file / PLAN_FILE).is_file():
        raise UserInputError("FILE", f"{args.file} is a directory without {PLAN_FILE}; expected a directory `dmt "
                                     f"generate` wrote, or one file it wrote")
    run = read_generated(args.file)
    if args.json:
        print(json_text({"ok": True, "problems": []}))
    else:
        print(f"{run.directory}: plan.json and its files agree ({run.plan.backend}, {run.plan.gpus} processes)")
    return 0


def _is_recipe(config) -> bool:
    """A mapping of the recipe's sections only (name, model, data, cluster, training, plan), with one of those a
    megatron.yaml never has."""
    return isinstance(config, dict) and set(config) <= set(Recipe.model_fields) and \
        bool(set(config) & {"cluster", "training", "plan", "name"})


def _require_world_size(args: argparse.Namespace) -> None:
    if args.world_size is None:  # a Kubernetes manifest states its own (nodes x processes per node)
        raise UserInputError("--world-size", "is required for a DeepSpeed JSON, an accelerate.yaml or a megatron.yaml: "
                                             "the processes the job will launch")


def print_problems(args: argparse.Namespace, problems: list) -> int:
    """The problems as `dmt validate` prints them (one JSON object with --json, else one line each on stderr, or that
    the file is valid); its exit code."""
    if args.json:
        print(json_text({"ok": not problems, "problems": [{"key": p.key, "message": p.message} for p in problems]}))
    elif problems:
        for problem in problems:
            print(f"{args.file}: {problem}", file=sys.stderr)
    else:
        print(f"{args.file}: valid for world size {args.world_size}")
    return 2 if problems else 0


def _accelerate(args: argparse.Namespace, config: dict) -> int:
    """An Accelerate config (accelerate.yaml: FSDP2's, or DeepSpeed's with its ParallelismConfig): `FILE: key:
    message` per problem, exit 2 when any."""
    trainer = read_json(args.trainer_args, "--trainer-args", what="HF TrainingArguments as JSON") \
        if args.trainer_args else None
    # DeepSpeed's accelerate.yaml (the one `dmt generate` writes for the deepspeed backend): Accelerate's keys, the
    # process count, its ParallelismConfig (Ulysses); the DeepSpeed JSON it names is checked as a FILE of its own
    # (one with an fsdp_config is an FSDP config whose distributed_type is wrong: the FSDP check says so)
    deepspeed = config.get("distributed_type") == "DEEPSPEED" and "fsdp_config" not in config
    check = validate_accelerate_deepspeed if deepspeed else validate_accelerate_fsdp
    return print_problems(args, check(config, args.world_size, trainer))


def _manifest(args: argparse.Namespace, documents: list[dict]) -> int:
    """A Kubernetes manifest (a TrainJob, a JobSet or a PyTorchJob, as `dmt k8s render` writes them or by hand),
    offline: `FILE: kind name: key: message` per problem, exit 2 when any."""
    problems = validate_manifest(documents, args.world_size)
    if problems or args.json:
        return print_problems(args, problems)
    checked = {SCHEMAS[(d["apiVersion"], d["kind"])]: d["kind"] for d in documents}
    against = "; ".join(f"{kind} of {release(file_name)}" for file_name, kind in checked.items())
    print(f"{args.file}: valid ({against}); submit it with `kubectl apply -f {args.file}`")
    return 0
