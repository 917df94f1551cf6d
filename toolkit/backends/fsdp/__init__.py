"""PyTorch FSDP2 (`fully_shard`) through Accelerate's FSDP plugin and the HF Trainer, HSDP included: its parts
(toolkit/spec/backend.py), declared in toolkit/spec/backends.py."""
