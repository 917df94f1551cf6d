"""The peak of an HF causal LM's loss on CPU, against the estimate's logits terms: which multiple of the fp32 logits
(tokens x vocabulary x 4 bytes) is alive at once, and in which op.

benchmarks/gpu_check.md's long-context check measured Llama 3.2 1B at 32K tokens 20% above the estimate on an H200,
a gap about the size of the logits' terms. This script finds the same moment on CPU, where it can run in a test's
time: a small Llama (hidden 64, 2 layers, full recompute) with Llama 3's 128,256-token vocabulary, so that the
logits outweigh everything else, trained one forward and backward under a dispatch mode that adds up the storage of
every tensor an op returns until it is freed (the parameters, made before, are left out:
toolkit/estimate/measure.py `peak_live_bytes`), against the estimate's peak of the loss (toolkit/estimate/memory.py
`loss_peak_bytes`).

The same for Megatron-Core (its `local` layer spec, the one that runs on CPU, built from the generated megatron.yaml
of the tiny Megatron recipe with this vocabulary, in this process as a world of one gloo rank), whose loss is its
own vocab-parallel cross-entropy.

Run: python benchmarks/loss_memory_cpu.py [--seq 1024 2048] (a few GB of memory; about a minute on 2 cores)
benchmarks/loss_memory_cpu.md holds a run's table and what it says.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import tempfile
from pathlib import Path

import torch
import transformers

from toolkit.estimate.measure import peak_live_bytes

REPO = Path(__file__).resolve().parents[1]

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
    return {"seq": seq, "model": f"HF Llama, {'tied' if tied else 'untied'}", "fp32_logits": logits,
            "forward_peak": forward, "forward_at": forward_at, "peak": peak, "peak_at": peak_at,
            "estimate": estimated_loss_peak(config, seq)}


def estimated_loss_peak(config, seq: int) -> int:
    """The estimate's peak of the loss (toolkit/estimate/memory.py loss_peak_bytes) for this model and run."""
    from toolkit.estimate.memory import loss_peak_bytes
    from toolkit.spec.model import spec_from_hf_dict
    from toolkit.spec.plan import resolve_plan

    spec = spec_from_hf_dict(config.to_dict(), "llama", filled=True)
    return loss_peak_bytes(spec, resolve_plan(spec, 1, zero=0, micro_batch=1, seq_len=seq, recompute="full",
                                              gpus_per_node=1))


def measure_megatron(seq: int) -> dict:
    """One forward and backward of Megatron-Core's GPT (local spec) as toolkit/train.py builds it, in bf16 with full
    recompute (toolkit/backends/megatron/training.py `megatron_step_peaks`)."""
    from toolkit.backends.megatron.build import init_distributed
    from toolkit.backends.megatron.training import megatron_step_peaks
    from toolkit.compat.megatron_cpu import cuda_on_cpu
    from toolkit.estimate.memory import loss_peak_bytes
    from toolkit.planner.recipe import recipe_plan
    from toolkit.spec.recipe import load_recipe, recipe_model

    if "MASTER_PORT" not in os.environ:  # a world of one gloo rank in this process
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed()
    tiny = REPO / "recipes" / "tiny-llama-megatron-cpu.yaml"
    text = (tiny.read_text().replace("vocab_size: 512", f"vocab_size: {VOCAB}")
            .replace("max_position_embeddings: 128", f"max_position_embeddings: {seq}")
            .replace("seq_len: 64", f"seq_len: {seq}").replace("global_batch: 16", "global_batch: 2")
            .replace("micro_batch: 4", "micro_batch: 1").replace("precision: fp32", "precision: bf16")
            .replace("data/tiny_corpus.txt", str(tiny.parent / "data" / "tiny_corpus.txt")))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "recipe.yaml").write_text(text)
        recipe = load_recipe(Path(tmp) / "recipe.yaml")
    model = recipe_model(recipe)
    plan = recipe_plan(recipe, model, recompute="full")
    torch.manual_seed(0)
    with cuda_on_cpu():
        peaks = megatron_step_peaks(recipe, model, plan, torch.randint(0, VOCAB, (1, seq)))
    (forward, forward_at), (peak, peak_at) = peaks["forward"], peaks["step"]
    return {"seq": seq, "model": "Megatron-Core local", "fp32_logits": seq * VOCAB * 4, "forward_peak": forward,
            "forward_at": forward_at, "peak": peak, "peak_at": peak_at, "estimate": loss_peak_bytes(model, plan)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    args = parser.parse_args()
    import megatron.core

    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, megatron-core {megatron.core.__version__}; model: Llama, hidden 64, 2 layers, "
          f"vocabulary {VOCAB}, bf16, full recompute, sdpa (HF), micro-batch 1")
    print("| seq | model | fp32 logits MiB | forward peak (x logits) | peak (x logits) | op at the peak | estimate's "
          "loss peak (error) |")
    print("|---:|---|---:|---:|---:|---|---:|")
    for seq in args.seq:
        for r in (measure(seq, True), measure(seq, False), measure_megatron(seq)):
            unit = r["fp32_logits"]
            print(f"| {seq} | {r['model']} | {unit / 2**20:.0f} | {r['forward_peak'] / 2**20:.0f} MiB "
                  f"({r['forward_peak'] / unit:.2f}) | {r['peak'] / 2**20:.0f} MiB ({r['peak'] / unit:.2f}) | "
                  f"`{r['peak_at']}` | {r['estimate'] / 2**20:.0f} MiB ({r['estimate'] / r['peak'] - 1:+.1%}) |",
                  flush=True)


if __name__ == "__main__":
    main()
