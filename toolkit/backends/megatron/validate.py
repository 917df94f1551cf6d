"""What training with a Megatron-Core plan reads of the generated files, checked against plan.json
(megatron_args.txt is Megatron-LM's to read)."""

from toolkit.validate.generated import read_megatron_yaml

# file -> (GeneratedRun field, reader)
READERS = {"megatron.yaml": ("megatron", read_megatron_yaml)}

# the check of an accelerate.yaml given to `accelerate launch` of this backend's job
accelerate_launch = None  # torchrun only
