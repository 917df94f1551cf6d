"""Check an Accelerate config (accelerate.yaml: FSDP2's, or DeepSpeed's with its ParallelismConfig) before launching; `dmt validate` hands it such files and prints
`FILE: key: message` per problem, exit 2 when any."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace, config: dict) -> int:
    from toolkit.cli.validate import report
    from toolkit.readers import read_json
    from toolkit.validate.accelerate_fsdp import validate_accelerate_deepspeed, validate_accelerate_fsdp

    trainer = read_json(args.trainer_args, "--trainer-args", what="HF TrainingArguments as JSON") \
        if args.trainer_args else None
    # DeepSpeed's accelerate.yaml says nothing to check but its ParallelismConfig (Ulysses); without one it is the
    # DeepSpeed JSON it names that `dmt validate` checks, as the FSDP check's line says
    ulysses = config.get("distributed_type") == "DEEPSPEED" and config.get("parallelism_config")
    check = validate_accelerate_deepspeed if ulysses else validate_accelerate_fsdp
    return report(args, check(config, args.world_size, trainer))
