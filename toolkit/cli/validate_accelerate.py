"""Check an Accelerate FSDP config (accelerate.yaml) before launching; `dmt validate` hands it such files and prints
`FILE: key: message` per problem, exit 2 when any."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace, config: dict) -> int:
    from toolkit.cli.validate import report
    from toolkit.readers import read_json
    from toolkit.validate.accelerate_fsdp import validate_accelerate_fsdp

    trainer = read_json(args.trainer_args, "--trainer-args", what="HF TrainingArguments as JSON") \
        if args.trainer_args else None
    return report(args, validate_accelerate_fsdp(config, args.world_size, trainer))
