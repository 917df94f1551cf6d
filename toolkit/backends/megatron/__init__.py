"""Megatron-Core's GPTModel, parallel state and distributed optimizer in the toolkit's own loop, launched by
torchrun."""

from toolkit.backends.backend import Backend

BACKEND = Backend(name="megatron", label="Megatron-Core", hf_modules=False, default_zero=0, launchers=("torchrun",),
                  conversion="megatron-to-hf", files=("megatron.yaml", "megatron_args.txt"), async_save=True)
