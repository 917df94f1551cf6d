"""DDP trains through the HF Trainer with nothing added."""

from toolkit.backends.hf_hooks import TrainerHooks
from toolkit.backends.hf_trainer import train  # noqa: F401

TRAINER_HOOKS = TrainerHooks()
