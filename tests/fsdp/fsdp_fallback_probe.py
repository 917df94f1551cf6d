"""The trap the CPU compatibility step exists for, shown with the libraries alone: under `accelerate launch` with an
FSDP accelerate.yaml on CPU ranks, the HF Trainer built from the generated trainer_args.json (the toolkit's
compatibility step NOT applied) gets plain DDP, and toolkit/backends/fsdp/train.py's post-preparation check says so.

Run as: accelerate launch --config_file GEN/accelerate.yaml tests/fsdp/fsdp_fallback_probe.py GEN/plan.json OUT.json
Rank 0 writes OUT.json: Accelerate's distributed type, whether the Trainer enabled FSDP, the prepared model's class,
and the check's one line (or null if it passed).
"""

import json
import sys
from pathlib import Path


def main(plan_json: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from toolkit.backends.fsdp.train import check_sharded
    from toolkit.errors import UserInputError
    from toolkit.spec.recipe import recipe_hf_config
    from toolkit.validate.generated import read_generated

    run = read_generated(Path(plan_json))
    args = TrainingArguments(**{**run.trainer_args, "output_dir": str(Path(out).parent / "probe-run")})
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**recipe_hf_config(run.recipe)))
    trainer = Trainer(model=model, args=args)
    prepared = trainer.accelerator.prepare(model)
    try:
        check_sharded(prepared, run.plan)
        verdict = None
    except UserInputError as exc:
        verdict = str(exc)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"distributed_type": str(trainer.accelerator.distributed_type),
                                         "fsdp_enabled": trainer.is_fsdp_enabled,
                                         "model": type(prepared).__name__, "check": verdict}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
