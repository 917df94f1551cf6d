"""Megatron-Core's GPTModel, parallel state and distributed optimizer in the toolkit's own loop, launched by
torchrun: its parts (toolkit/spec/backend.py), declared in toolkit/spec/backends.py."""
