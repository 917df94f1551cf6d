"""Check an Accelerate FSDP config (accelerate.yaml) before launching; `dmt validate` hands it such files.

Shaped like every verb module (add_arguments + run); prints `FILE: key: message` per problem, exit 2 when any.
"""

from __future__ import annotations

import argparse
import json
import sys


def run(args: argparse.Namespace, config: dict) -> int:
    from toolkit.readers import read_json
    from toolkit.validate.accelerate_fsdp import validate_accelerate_fsdp

    trainer = read_json(args.trainer_args, "--trainer-args", what="HF TrainingArguments as JSON") \
        if args.trainer_args else None
    problems = validate_accelerate_fsdp(config, args.world_size, trainer)
    if args.json:
        print(json.dumps({"ok": not problems, "problems": [{"key": p.key, "message": p.message} for p in problems]}))
    elif problems:
        for problem in problems:
            print(f"{args.file}: {problem}", file=sys.stderr)
    else:
        print(f"{args.file}: valid for world size {args.world_size}")
    return 2 if problems else 0
