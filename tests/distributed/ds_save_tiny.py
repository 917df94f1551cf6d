"""Train a tiny random-init HF Llama for a few steps with bare DeepSpeed ZeRO on CPU ranks and save a checkpoint, once
per --save, one engine after the other in the same launch (a launch's start costs more than a tiny model's steps).

Run as: deepspeed --num_gpus 2 tests/distributed/ds_save_tiny.py --save STAGE:DIR[:tied|:config] [--save ...]
[--hidden H --layers L]
`:config` builds the model DIR/config.json describes (an HF config with its model_type: the MoE families) instead.
Writes DIR/<tag>/ (DeepSpeed's own layout, `latest` pointer), DIR/config.json (the HF config) and
DIR/model_states_rank<r>.json: the bytes of model state each rank holds after the step, read from DeepSpeed's live
objects, which tests compare with the memory model.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


def _bytes(tensors, seen: set) -> int:
    """Bytes of distinct storages among `tensors` (views of one buffer count once)."""
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(engine, stage: int) -> dict:
    """Per-rank bytes of what DeepSpeed keeps: fp32 master partitions, Adam moments, 16-bit weights."""
    zero = engine.optimizer
    fp32 = zero.fp32_partitioned_groups_flat if stage == 3 else zero.single_partition_of_fp32_groups
    moments = [v for state in zero.optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    seen: set = set()
    fp32_bytes = _bytes(fp32, seen)
    moment_bytes = _bytes(moments, seen)
    params = list(engine.module.parameters())
    if stage == 3:  # each rank keeps its partition of every 16-bit parameter; the gathered copies are released
        weights = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params)
    else:
        weights = _bytes(params, set())
    return {
        "stage": stage,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "fp32_partition_bytes": fp32_bytes,
        "optimizer_state_bytes": moment_bytes,
        "optimizer_bytes": fp32_bytes + moment_bytes,
        "weights_bytes": weights,
        "num_params": sum(p.ds_numel if stage == 3 else p.numel() for p in params),
    }


def save(stage: int, out: str, model_from: str, args: argparse.Namespace) -> None:
    """One model, seeded alike whatever came before it in the launch, trained args.steps steps at `stage` and saved
    into `out`: a tiny Llama (`model_from` "tied": its embeddings tied), or out/config.json's model ("config")."""
    torch.manual_seed(0)
    if model_from == "config":
        with open(os.path.join(out, "config.json")) as handle:
            config = AutoConfig.for_model(**json.load(handle))
        model = AutoModelForCausalLM.from_config(config)
    else:
        heads = max(4, args.hidden // 64)
        config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                             num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                             vocab_size=args.vocab, max_position_embeddings=max(64, args.seq),
                             tie_word_embeddings=model_from == "tied", bos_token_id=0, eos_token_id=0)
        model = LlamaForCausalLM(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (2, args.seq), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"model_states_rank{dist.get_rank()}.json"), "w") as handle:
        json.dump(model_state_bytes(engine, stage), handle)
    engine.save_checkpoint(out)
    if dist.get_rank() == 0:
        config.save_pretrained(out)
    dist.barrier()
    engine.destroy()  # its hooks and buffers go before the next engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", action="append", required=True, metavar="STAGE:DIR[:tied|:config]")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=301)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    for spec in args.save:
        stage, out, *model_from = spec.split(":")
        save(int(stage), out, "".join(model_from), args)
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit after all work is done


if __name__ == "__main__":
    main()
