"""DDP holds what DeepSpeed's ZeRO-0 holds: the whole model, its gradients and optimizer states on every rank."""

from toolkit.backends.deepspeed.memory import alive_at_backward_start, model_states, padded_vocab, step_fp32_grads  # noqa: F401
