"""dm-toolkit: estimate, plan, generate, launch, convert and verify distributed training around DeepSpeed, Megatron-Core, HF and SLURM."""

__version__ = "0.1.0"


def _quiet_bitsandbytes_on_cpu() -> None:
    """bitsandbytes 0.50 warns, whenever something imports it on a machine without a GPU, that an optional CPU kernel
    from the HF hub is not installed; its own CPU code runs instead (QLoRA on CPU ranks, tested), so the line is noise
    in every command's output."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


_quiet_bitsandbytes_on_cpu()
