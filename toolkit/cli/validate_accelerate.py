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
    check = validate_accelerate_deepspeed if config.get("distributed_type") == "DEEPSPEED" else validate_accelerate_fsdp
    return report(args, check(config, args.world_size, trainer))
