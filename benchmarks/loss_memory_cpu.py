"""The peak of an HF causal LM's loss on CPU, against the estimate's logits terms: which multiple of the fp32 logits
(tokens x vocabulary x 4 bytes) is alive at once, and in which op.

benchmarks/gpu_check.md's long-context check measured Llama 3.2 1B at 32K tokens 20% above the estimate on an H200,
a gap about the size of the logits' terms. This script finds the same moment on CPU, where it can run in a test's
time: a small Llama (hidden 64, 2 layers, full recompute) with Llama 3's 128,256-token vocabulary, so that the
logits outweigh everything else, trained one forward and backward under a dispatch mode that adds up the storage of
every tensor an op returns until it is freed (the parameters, made before, are left out). The estimate counts two
fp32 logits in the head (the log-softmax output kept for backward, toolkit/estimate/activations.py
`head_bytes_per_token`, and its gradient, toolkit/estimate/memory.py `logits_grad`).

Run: python benchmarks/loss_memory_cpu.py [--seq 1024 2048] (a few GB of memory; under a minute on 2 cores)
benchmarks/loss_memory_cpu.md holds a run's table and what it says.
"""

from __future__ import annotations

import argparse
import platform
import weakref

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB = 128256  # Llama 3's


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops have returned and that are still alive; the peak and the op that reached it."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.at = ""
        self.held: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(tensor, torch.Tensor) or tensor._is_view():
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.held:
                continue
            self.held.add(key)
            self.live += size
            weakref.finalize(storage, self._freed, key, size)
            if self.live > self.peak:
                self.peak, self.at = self.live, func.__name__
        return out

    def _freed(self, key: int, size: int) -> None:
        self.held.discard(key)
        self.live -= size


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
    with LiveBytes() as live:
        loss = model(input_ids=ids, labels=ids).loss
        forward, forward_at = live.peak, live.at
        loss.backward()
    logits = seq * VOCAB * 4
    return {"seq": seq, "tied": tied, "fp32_logits": logits, "forward_peak": forward, "forward_at": forward_at,
            "peak": live.peak, "peak_at": live.at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; model: Llama, hidden 64, 2 layers, vocabulary {VOCAB}, bf16, full recompute, "
          f"sdpa, micro-batch 1")
    print("| seq | tied | fp32 logits MiB | forward peak (x logits) | peak (x logits) | op at the peak | estimate's "
          "logits terms |")
    print("|---:|---|---:|---:|---:|---|---:|")
    for seq in args.seq:
        for tied in (True, False):
            r = measure(seq, tied)
            unit = r["fp32_logits"]
            print(f"| {seq} | {'yes' if tied else 'no'} | {unit / 2**20:.0f} | {r['forward_peak'] / 2**20:.0f} MiB "
                  f"({r['forward_peak'] / unit:.2f}) | {r['peak'] / 2**20:.0f} MiB ({r['peak'] / unit:.2f}) | "
                  f"`{r['peak_at']}` | 2.00 |", flush=True)


if __name__ == "__main__":
    main()
