"""DeepSpeed under the HF Trainer (ZeRO 0-3, offload), launched by deepspeed, accelerate or torchrun: its parts
(toolkit/spec/backend.py), declared in toolkit/spec/backends.py."""
