"""The training backends' code, one package each (deepspeed/, fsdp/, megatron/), whose parts follow the Protocols of
toolkit/spec/backend.py and are declared in the registry toolkit/spec/backends.py. Beside them, what the HF-Trainer
backends share (hf_trainer.py: the Trainer; hf_inputs.py: what it is built from; hf_hooks.py: what each of them adds;
hf_guard.py, hf_callbacks.py, peft_model.py, data.py, sft_data.py, resume.py), what train.py hands every backend
(context.py: TrainContext), and what every training loop calls (loop.py)."""
