"""dm-toolkit: estimate, plan, generate, launch, convert and verify distributed training around DeepSpeed, Megatron-Core, HF and SLURM."""

__version__ = "0.1.0"
