"""Measure the model-state bytes each rank of a real DeepSpeed ZeRO-3 LoRA or QLoRA step holds (PEFT adapters on a
frozen bf16 or 4-bit bitsandbytes base), from the live DeepSpeed objects.

Run as:
    deepspeed --num_gpus 2 --master_port PORT tests/distributed/lora_probe.py \
        --method lora|qlora --config-json MODEL_CONFIG.json --base DIR --out OUT.json

The base is built the way toolkit/backends/peft_model.py builds it (rank 0 saves a random fp32 base to --base; every
rank loads it with from_pretrained in bf16 under ZeRO-3's zero.Init, or in 4-bit nf4 with bf16 storage; PEFT adds
LoRA r=16 on every linear module), then DeepSpeed (bf16, ZeRO-3, AdamW over the trainable parameters) takes one step
on random tokens. The bytes are read as tests/distributed/zero_probe.py reads them (model_state_snapshot,
gradient_snapshot), plus the bitsandbytes quantisation state (block scales and codes: buffers, not parameters).
Rank 0 writes OUT.json, one object per rank.
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402
from zero_probe import Storages, gradient_snapshot, model_state_snapshot  # noqa: E402

from toolkit.spec.finetune import FinetuneOptions  # noqa: E402


def quant_state_bytes(model) -> int:
    """Bytes of every 4-bit weight's quantisation state (absmax, nested absmax, codes), counted once per storage."""
    storages = Storages()
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        while state is not None:
            for name in ("absmax", "code", "offset"):
                storages.add(getattr(state, name, None))
            state = getattr(state, "state2", None)
    return storages.total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=("lora", "qlora"), required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--base", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 3}, "steps_per_print": 1_000_000,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}}}
    deepspeed.init_distributed()
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (from_pretrained builds under zero.Init while it lives)
    from toolkit.backends.peft_model import _without_zero3_init, lora_config, quantization_config
    from toolkit.spec.model import load_model_spec
    from toolkit.spec.plan import resolve_plan

    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(args.base, "config.json")):
        with _without_zero3_init():
            torch.manual_seed(0)
            with open(args.config_json) as handle:
                config = AutoConfig.for_model(**json.load(handle))
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(args.base)
    dist.barrier()
    finetune = FinetuneOptions(method=args.method, r=16, alpha=32)
    plan = resolve_plan(load_model_spec(args.config_json), 2, zero=3, seq_len=32, finetune=finetune)
    extra = {"quantization_config": quantization_config(plan)} if args.method == "qlora" else {}
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16, **extra)
    from peft import get_peft_model

    model = get_peft_model(model, lora_config(finetune))
    trainable, total = model.get_nb_trainable_parameters()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1 + rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    grads = gradient_snapshot(engine)
    engine.step()
    record = dict(rank=rank, world_size=world, method=args.method, trainable=trainable, total=total,
                  loss=float(loss.detach().float()), **model_state_snapshot(engine, 3),
                  gradient_bytes=grads["gradient_bytes"], gradient_detail=grads["gradient_detail"],
                  quant_state_bytes=quant_state_bytes(engine.module))
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        with open(args.out + ".tmp", "w") as handle:
            json.dump(sorted(records, key=lambda r: r["rank"]), handle, indent=1, default=str)
        os.replace(args.out + ".tmp", args.out)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit after all the work is done


if __name__ == "__main__":
    main()
