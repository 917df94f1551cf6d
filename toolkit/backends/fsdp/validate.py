"""What training with an FSDP2 plan reads of the generated files, each checked against plan.json; accelerate.yaml is
checked against the trainer arguments too, since both build the same FSDP2 plugin."""

from toolkit.validate.generated import read_accelerate_yaml, read_trainer_args

# file -> (GeneratedRun field, reader)
READERS = {"trainer_args.json": ("trainer_args", read_trainer_args),
           "accelerate.yaml": ("accelerate", read_accelerate_yaml)}

# the check of an accelerate.yaml given to `accelerate launch` of this backend's job
from toolkit.validate.accelerate_fsdp import validate_accelerate_fsdp as accelerate_launch  # noqa: F401
