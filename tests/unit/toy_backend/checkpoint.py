"""DDP's checkpoints are the HF Trainer's own (checkpoint-N with model.safetensors): no format of its own to detect,
check or describe, nothing to convert; `dmt ckpt` reads them as HF Trainer checkpoints."""

FORMATS: tuple[str, ...] = ()
MANIFEST_FORMAT = "hf-trainer"
TO_HF = None
detect = verify = inspect = to_hf = None
