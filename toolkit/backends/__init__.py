"""The training backends, one package each (deepspeed/, fsdp/, megatron/: see backend.py for what each declares),
and the registry the rest of the toolkit walks. Beside them, what the HF-Trainer backends share (hf_trainer.py,
hf_path.py: what each of them adds, hf_guard.py, hf_callbacks.py, peft_model.py, data.py, sft_data.py, resume.py),
and what every training loop calls (loop.py).

Adding a backend is one package declaring `BACKEND` plus its line below."""

from __future__ import annotations

from toolkit.backends import deepspeed, fsdp, megatron
from toolkit.backends.backend import Backend

BACKENDS: dict[str, Backend] = {package.BACKEND.name: package.BACKEND for package in (deepspeed, megatron, fsdp)}
NAMES: tuple[str, ...] = tuple(BACKENDS)


def backend_of(plan) -> Backend:
    """The backend a plan (or anything with a `backend` name, or the name itself) trains with."""
    return BACKENDS[plan if isinstance(plan, str) else plan.backend]
