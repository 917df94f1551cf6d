"""DDP trains through the HF Trainer with nothing added."""

from toolkit.backends.hf_path import HFPath
from toolkit.backends.hf_trainer import train  # noqa: F401

HF_PATH = HFPath()
