"""Training backends behind toolkit/train.py: HF Trainer with DeepSpeed/Accelerate (and, later, Megatron-Core)."""
