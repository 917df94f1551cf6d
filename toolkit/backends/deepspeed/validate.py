"""What training with a DeepSpeed plan reads of the generated files, each checked against plan.json (accelerate.yaml
is Accelerate's launcher's to read)."""

from toolkit.validate.generated import read_deepspeed_json, read_trainer_args

# file -> (GeneratedRun field, reader)
READERS = {"deepspeed.json": ("deepspeed", read_deepspeed_json), "trainer_args.json": ("trainer_args", read_trainer_args)}

# the check of an accelerate.yaml given to `accelerate launch` of this backend's job
from toolkit.validate.accelerate_fsdp import validate_accelerate_deepspeed as accelerate_launch  # noqa: F401
