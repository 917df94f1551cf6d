"""DDP's step: one all-reduce of the gradients, as ZeRO-0's."""

from toolkit.backends.deepspeed.timing import data_parallel_and_optimizer, execution_path  # noqa: F401
