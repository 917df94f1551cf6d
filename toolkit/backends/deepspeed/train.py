"""Training a DeepSpeed plan: the HF Trainer with the generated deepspeed.json (toolkit/backends/hf_trainer.py)."""

from toolkit.backends.hf_trainer import train_generated as train  # noqa: F401 (the backend's entry, train.py calls it)
