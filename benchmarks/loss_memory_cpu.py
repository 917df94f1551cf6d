"""The peak of an HF causal LM's loss on CPU, against the estimate's logits terms: which multiple of the fp32 logits
(tokens x vocabulary x 4 bytes) is alive at once, and in which op.

benchmarks/gpu_check.md's long-context check measured Llama 3.2 1B at 32K tokens 20% above the estimate on an H200,
a gap about the size of the logits' terms. This script finds the same moment on CPU, where it can run in a test's
time: a small Llama (hidden 64, 2 layers, full recompute) with Llama 3's 128,256-token vocabulary, so that the
logits outweigh everything else, trained one forward and backward under a dispatch mode that adds up the storage of
every tensor an op returns until it is freed (the parameters, made before, are left out:
toolkit/estimate/measure.py `peak_live_bytes`), against the estimate's peak of the loss (toolkit/estimate/memory.py
`loss_peak_bytes`).

Run: python benchmarks/loss_memory_cpu.py [--seq 1024 2048] (a few GB of memory; under a minute on 2 cores)
benchmarks/loss_memory_cpu.md holds a run's table and what it says.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from toolkit.estimate.measure import peak_live_bytes  # noqa: E402

VOCAB = 128256  # Llama 3's


def measure(seq: int, tied: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                         tie_word_embeddings=tied, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # transformers 5.17's name
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, VOCAB, (1, seq))
    forward, forward_at = peak_live_bytes(lambda: model(input_ids=ids, labels=ids))
    peak, peak_at = peak_live_bytes(lambda: model(input_ids=ids, labels=ids).loss.backward())
    logits = seq * VOCAB * 4
    return {"seq": seq, "tied": tied, "fp32_logits": logits, "forward_peak": forward, "forward_at": forward_at,
            "peak": peak, "peak_at": peak_at, "estimate": estimated_loss_peak(config, seq)}


def estimated_loss_peak(config, seq: int) -> int:
    """The estimate's peak of the loss (toolkit/estimate/memory.py loss_peak_bytes) for this model and run."""
    from toolkit.estimate.memory import loss_peak_bytes
    from toolkit.spec.model import spec_from_hf_dict
    from toolkit.spec.plan import resolve_plan

    spec = spec_from_hf_dict(config.to_dict(), "llama", filled=True)
    return loss_peak_bytes(spec, resolve_plan(spec, 1, zero=0, micro_batch=1, seq_len=seq, recompute="full",
                                              gpus_per_node=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; model: Llama, hidden 64, 2 layers, vocabulary {VOCAB}, bf16, full recompute, "
          f"sdpa, micro-batch 1")
    print("| seq | tied | fp32 logits MiB | forward peak (x logits) | peak (x logits) | op at the peak | estimate's "
          "loss peak (error) |")
    print("|---:|---|---:|---:|---:|---|---:|")
    for seq in args.seq:
        for tied in (True, False):
            r = measure(seq, tied)
            unit = r["fp32_logits"]
            print(f"| {seq} | {'yes' if tied else 'no'} | {unit / 2**20:.0f} | {r['forward_peak'] / 2**20:.0f} MiB "
                  f"({r['forward_peak'] / unit:.2f}) | {r['peak'] / 2**20:.0f} MiB ({r['peak'] / unit:.2f}) | "
                  f"`{r['peak_at']}` | {r['estimate'] / 2**20:.0f} MiB ({r['estimate'] / r['peak'] - 1:+.1%}) |",
                  flush=True)


if __name__ == "__main__":
    main()
