"""Predicted longest sequences (and memory at a published length) against the published long-context records;
prints the table of benchmarks/max_seq_len.md. Run: python benchmarks/max_seq_len.py"""

from __future__ import annotations

from toolkit.estimate.memory import estimate_memory
from toolkit.planner.max_seq_len import longest_sequence
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

# ALST (arXiv:2506.13996, Snowflake's blog and DeepSpeed's Ulysses-ALST tutorial): Llama-3.1-8B, bf16, batch 1,
# ZeRO-3 with the optimizer (and, on one GPU, the parameters) offloaded, checkpointing with offload to the host,
# TiledMLP, tiled logits+loss, Ulysses over every GPU
ALST = dict(backend="deepspeed", zero=3, offload_optimizer="cpu", recompute="full", tiled_mlp=True, tiled_loss=True,
            offload_activations="cpu")
RECORDS = [  # (what, model, gpus, options, published max sequence length)
    ("ALST 1 x H100", "llama-3.1-8b", 1, dict(ALST, offload_params="cpu"), 500_000),
    ("ALST 8 x H100", "llama-3.1-8b", 8, dict(ALST, sp=8), 3_700_000),
    ("ALST 32 x H100", "llama-3.1-8b", 32, dict(ALST, sp=32), 15_000_000),
]
# TRL v1.13 long-context guide (docs/source/long_context_training.md, release notes): Qwen3-8B, FSDP2 + context
# parallel 8 on one 8 x H100 node, bf16, batch 1, chunked_nll loss, checkpointing with offload: 1,048,576 tokens
# measured at 56.2 GB per GPU (a length it trains, not its maximum)
TRL = ("TRL CP 8 x H100", "qwen3-8b", 8, dict(backend="fsdp", cp=8, recompute="full", tiled_loss=True,
                                               offload_activations="cpu"), 1_048_576, 56.2e9)


def main() -> None:
    gpu = get_gpu("h100-80gb")
    print("| record | GPUs | published max seq | predicted max seq | error | limit at the next length |")
    print("|---|---|---|---|---|---|")
    for what, name, gpus, options, published in RECORDS:
        found = longest_sequence(load_model_spec(name), gpus, gpu, **options)
        error = (found.max_seq_len - published) / published
        print(f"| {what} | {gpus} | {published:,} | {found.max_seq_len:,} | {error:+.1%} | "
              f"{found.limit['component']} |")
    what, name, gpus, options, length, measured = TRL
    model = load_model_spec(name)
    memory = estimate_memory(model, resolve_plan(model, gpus, seq_len=length, **options))
    found = longest_sequence(model, gpus, gpu, **options)
    print(f"\n{what}: at {length:,} tokens predicted {memory.total / 1e9:.1f} GB per GPU against {measured / 1e9:.1f} GB "
          f"measured ({(memory.total - measured) / measured:+.1%}); predicted max {found.max_seq_len:,}")


if __name__ == "__main__":
    main()
