"""What DDP's training reads of the generated files."""

from toolkit.validate.generated import read_trainer_args

READERS = {"trainer_args.json": ("trainer_args", read_trainer_args)}
accelerate_launch = None
