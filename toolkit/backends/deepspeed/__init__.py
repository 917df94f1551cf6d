"""DeepSpeed under the HF Trainer (ZeRO 0-3, offload), launched by deepspeed, accelerate or torchrun."""

from toolkit.backends.backend import Backend

BACKEND = Backend(name="deepspeed", label="DeepSpeed", hf_modules=True, default_zero=1,
                  launchers=("deepspeed", "accelerate", "torchrun"), conversion="zero-to-hf",
                  files=("deepspeed.json", "accelerate.yaml", "trainer_args.json"))
