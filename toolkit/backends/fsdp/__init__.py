"""PyTorch FSDP2 (`fully_shard`) through Accelerate's FSDP plugin and the HF Trainer, HSDP included."""

from toolkit.backends.backend import Backend

BACKEND = Backend(name="fsdp", label="FSDP2", hf_modules=True, default_zero=0, launchers=("accelerate", "torchrun"),
                  conversion="fsdp-to-hf", files=("accelerate.yaml", "trainer_args.json"), article="an",
                  async_save=True)
