"""Save an FSDP2 SHARDED_STATE_DICT checkpoint of a random-init Llama the way Accelerate does, for the conversion
benchmark (benchmarks/fsdp_to_hf_speed.py): Accelerate's FSDP2 preparation (fully_shard per decoder layer) and its
save_fsdp_model (torch DCP, one __R_0.distcp per rank), on CPU ranks through the toolkit's compatibility step.

Run: torchrun --nproc_per_node 2 benchmarks/fsdp_save.py OUT_DIR [--hidden 1024 --layers 16 --vocab 32000]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.compat.accelerate_seams import fsdp_on_cpu_ranks

    config = AutoConfig.for_model("llama", hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                  num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
                                  vocab_size=args.vocab, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False)
    with fsdp_on_cpu_ranks():
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    args.out.mkdir(parents=True, exist_ok=True)
    save_fsdp_model(plugin, accelerator, model, str(args.out))
    if accelerator.is_main_process:
        config.save_pretrained(args.out)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
