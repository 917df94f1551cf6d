"""Train a tiny random-init HF Llama for a few steps with bare DeepSpeed ZeRO on CPU ranks and save a checkpoint.

Run as: deepspeed --num_gpus 2 tests/checkpoint/ds_save_tiny.py --stage 3 --out DIR [--tied] [--hidden H --layers L]
Writes DIR/<tag>/ (DeepSpeed's own layout, `latest` pointer) and DIR/config.json (the HF config).
"""

import argparse
import os

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=301)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(0)
    heads = max(4, args.hidden // 64)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=args.vocab,
                         max_position_embeddings=max(64, args.seq),
                         tie_word_embeddings=args.tied, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (2, args.seq), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(args.out)
    if dist.get_rank() == 0:
        config.save_pretrained(args.out)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit after all work is done


if __name__ == "__main__":
    main()
