"""What training with a DeepSpeed plan reads of the generated files, each checked against plan.json; accelerate.yaml
(Accelerate's launcher's to read) is checked against the trainer arguments too: both give Ulysses' ParallelismConfig."""

from toolkit.validate.generated import read_accelerate_yaml, read_deepspeed_json, read_trainer_args

# file -> (GeneratedRun field, reader)
READERS = {"deepspeed.json": ("deepspeed", read_deepspeed_json), "trainer_args.json": ("trainer_args", read_trainer_args),
           "accelerate.yaml": ("accelerate", read_accelerate_yaml)}

# the check of an accelerate.yaml given to `accelerate launch` of this backend's job
from toolkit.validate.accelerate_fsdp import validate_accelerate_deepspeed as accelerate_launch  # noqa: F401
