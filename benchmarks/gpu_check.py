"""The toolkit's predictions against one real GPU: memory, step time, GEMM efficiency, and `dmt health` with NCCL.

Needs a CUDA GPU (it is not part of `make test`). For each case it writes a recipe, trains it for real with the
toolkit's own launch line (`deepspeed --num_gpus 1 toolkit/train.py --recipe R`, or `torchrun ... --backend
megatron`), reads the peak of `torch.cuda.max_memory_allocated()` that metrics.jsonl records on GPUs and the measured
step time, and puts them beside `dmt estimate`'s figures for the same recipe and plan:

- memory: the estimate less its CUDA-context allowance and its allocator (fragmentation) margin against the
  allocator's peak `max_memory_allocated`, and the estimate less the context alone against `max_memory_reserved`
  (the CUDA context is outside PyTorch's allocator, so neither figure can hold it);
- time: the predicted step time (catalogue peak of the GPU named in the recipe, efficiency curve of
  toolkit/estimate/efficiency.py) against the median measured step after warm-up.

With `--cross-validate`, each case is then re-predicted with a calibration (`dmt calibrate`) fitted on the other
cases of its execution path (leave-one-out, as benchmarks/calibration_cpu.py does on a CPU host): a case's run
directory keeps metrics.jsonl and run_plan.json (its checkpoints are removed).

It also times bf16 GEMMs of transformer shapes and prints the fraction of the catalogue's dense peak they reach
beside `gemm_efficiency`, the curve the step-time model uses (that curve is calibrated on end-to-end training
throughput, so it sits below the bare GEMM), and runs `dmt health --nproc 1` (NCCL, one rank: the matmul and
memory checks; no link to measure on one GPU).

The long-context check (LONG_CONTEXT_CASES; `--long-context`, under 2 minutes on an H100) runs one forward and
backward of Llama 3.2 1B at 32K tokens with full recompute, as it is and with DeepSpeed's TiledMLP and
TiledFusedLogitsLoss (the tile counts the estimate assumes, toolkit/estimate/long_context.py), and puts the peak of
`torch.cuda.max_memory_allocated()` above the weights beside the estimate's activations, transient terms and
gradients. Without a GPU it says so and skips.

With `--context-parallel` (2 GPUs or more) it trains an FSDP2 plan with torch context parallel (cp=2) against the
same plan on one GPU without it and compares the per-step losses: context parallel does not run on CPU ranks.

With `--fp8 RECIPE` (Transformer Engine installed; Hopper for delayed/tensorwise/blockwise, Blackwell for mxfp8) it
runs one forward and backward of a Llama 3.1 8B decoder layer built from Transformer Engine's modules as
Megatron-Core's TE spec builds it, in bf16 and in the recipe, and puts what the forward leaves allocated (saved
activations, and in fp8 the weight copies the first micro-batch caches) beside the estimate's terms.

With `--profile` the first case also records steps WARMUP_STEPS+1 and +2 with torch.profiler (train.py
--profile-steps) and `dmt report --breakdown --json` reads the traces through Holistic Trace Analysis (GPU kernels:
compute, communication, idle) beside the predicted terms; the result's `breakdown` holds what it said.

Usage: python benchmarks/gpu_check.py --work /tmp/gpu_check --out result.json [--cases NAME ...] [--long-context]
       [--context-parallel] [--profile] [--fp8 tensorwise]
Only the long-context check: --cases --skip-health --skip-gemm --long-context
benchmarks/gpu_check.md holds a run's figures with the machine named.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

GiB = 1024**3
WARMUP_STEPS = 3

# name -> (preset, backend, seq_len, micro_batch, grad_accum, zero, recompute)
CASES = {
    "qwen0.5b-s2048-mb4": ("qwen2.5-0.5b", "deepspeed", 2048, 4, 1, 2, "none"),
    "llama1b-s2048-mb4": ("llama-3.2-1b", "deepspeed", 2048, 4, 1, 2, "none"),
    "llama1b-s4096-mb2-full": ("llama-3.2-1b", "deepspeed", 4096, 2, 2, 2, "full"),
    "llama1b-s2048-mb8-zero3": ("llama-3.2-1b", "deepspeed", 2048, 8, 1, 3, "none"),
    "llama1b-megatron-s2048-mb1": ("llama-3.2-1b", "megatron", 2048, 1, 4, None, "none"),
}

# name -> (preset, seq_len, tiled): Llama 3.2 1B's 128K vocabulary makes the fp32 logits the largest term untiled
LONG_CONTEXT_CASES = {
    "llama1b-s32768-full": ("llama-3.2-1b", 32768, False),
    "llama1b-s32768-full-tiled": ("llama-3.2-1b", 32768, True),
}
# the estimate's terms that are not tensors of PyTorch's allocator (the CUDA context) or not the run's (fragmentation)
OUTSIDE_ALLOCATED = ("cuda_context", "allocator_margin")


def recipe_text(name: str, corpus: Path, gpu: str, steps: int) -> str:
    preset, backend, seq, micro, accum, zero, recompute = CASES[name]
    plan = [f"backend: {backend}", f"micro_batch: {micro}", f"recompute: {recompute}", "precision: bf16"]
    plan += [f"zero: {zero}"] if zero is not None else []
    # Transformer Engine is not on every GPU image; Megatron-Core's own modules then
    plan += ["transformer_impl: local"] if backend == "megatron" and not _has_te() else []
    return "\n".join([
        f"name: {name}",
        f"model: {{source: {preset}}}",
        f"data: {{train_files: [{corpus}], eval_fraction: 0.0, tokenizer: {{vocab_size: 512}}}}",
        f"cluster: {{gpus: 1, gpus_per_node: 1, gpu: {gpu}, accelerator: gpu}}",
        f"training: {{seq_len: {seq}, global_batch: {micro * accum}, max_steps: {steps}, learning_rate: 1.0e-4, "
        f"logging_steps: 1, save_steps: 0}}",
        "plan: {" + ", ".join(plan) + "}",
    ]) + "\n"


def _has_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def predicted(recipe_path: Path) -> dict:
    """The prediction plan.json and the run's run_plan.json record for the recipe (toolkit.planner.recipe)."""
    from toolkit.planner.recipe import recipe_plan, recipe_prediction
    from toolkit.spec.recipe import load_recipe, recipe_model

    recipe = load_recipe(recipe_path)
    model = recipe_model(recipe)
    record = recipe_prediction(recipe, model, recipe_plan(recipe, model))
    return {"memory": record.memory_bytes.model_dump(), "overhead": record.overhead_bytes,
            "step_time_s": record.step_time_s, "mfu": record.mfu}


def run_case(name: str, work: Path, corpus: Path, gpu: str, steps: int, profile: bool = False) -> dict:
    case_dir = work / name
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    recipe = case_dir / "recipe.yaml"
    recipe.write_text(recipe_text(name, corpus, gpu, steps))
    out = case_dir / "run"
    backend = CASES[name][1]
    if backend == "megatron":
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29511"]
    else:
        launch = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", "29511"]
    command = launch + ["--module", "toolkit.train", "--recipe", str(recipe), "--output-dir", str(out)]
    command += ["--backend", "megatron"] if backend == "megatron" else []
    profiled = f"{WARMUP_STEPS + 1}-{WARMUP_STEPS + 2}"
    command += ["--profile-steps", profiled] if profile else []
    started = time.time()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    result = {"case": name, "preset": CASES[name][0], "backend": backend, "seq_len": CASES[name][2],
              "micro_batch": CASES[name][3], "grad_accum": CASES[name][4], "zero": CASES[name][5],
              "recompute": CASES[name][6], "wall_s": round(time.time() - started, 1), "rc": proc.returncode}
    records = []
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if proc.returncode != 0 or not records:
        result["error"] = (proc.stdout + proc.stderr)[-3000:]
        return result
    tokens_per_step = CASES[name][2] * CASES[name][3] * CASES[name][4]
    times = [tokens_per_step / r["tokens_per_s"] for r in records[WARMUP_STEPS:] if r.get("tokens_per_s")]
    result["measured_step_s"] = statistics.median(times)
    result["measured_max_allocated"] = max(r.get("gpu_max_allocated_bytes", 0) for r in records)
    result["measured_max_reserved"] = max(r.get("gpu_max_reserved_bytes", 0) for r in records)
    result["final_loss"] = records[-1]["loss"]
    estimate = predicted(recipe)
    result["estimate"] = estimate
    reserved_side = estimate["memory"]["total"] - estimate["overhead"].get("cuda_context", 0)
    allocated_side = reserved_side - estimate["overhead"].get("allocator_margin", 0)
    result["predicted_allocated"], result["predicted_reserved"] = allocated_side, reserved_side
    result["memory_error"] = allocated_side / result["measured_max_allocated"] - 1
    result["reserved_error"] = reserved_side / result["measured_max_reserved"] - 1
    result["time_error"] = estimate["step_time_s"] / result["measured_step_s"] - 1
    if profile:  # the traces through Holistic Trace Analysis, beside the predicted terms
        report = subprocess.run([sys.executable, "-m", "toolkit", "report", str(out), "--breakdown", "--json"],
                                cwd=REPO, capture_output=True, text=True)
        if report.returncode == 0:
            breakdown = json.loads(report.stdout)["runs"][0]["breakdown"] or {}
            result["breakdown"] = {k: breakdown.get(k) for k in ("source", "measured", "predicted", "predicted_terms",
                                                                 "gap", "stragglers", "steps")}
        else:
            result["breakdown_error"] = (report.stdout + report.stderr)[-2000:]
    for checkpoint in out.glob("checkpoint-*"):  # tens of GB; metrics.jsonl and run_plan.json stay for calibrate
        shutil.rmtree(checkpoint, ignore_errors=True)
    result["run_dir"] = str(out)
    return result


def long_context_case(name: str) -> dict:
    """One training forward and backward (no optimizer step) of the case's model on the GPU: the allocator's peak
    above the weights against the estimate's activations, its transient terms and the gradients as this run keeps
    them (bf16, the model's dtype; the estimate's fp32 gradients are DeepSpeed's)."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from toolkit.estimate.long_context import loss_tiles, mlp_tiles
    from toolkit.estimate.memory import activation_setup, estimate_memory, loss_peak_bytes
    from toolkit.spec.model import PRESET_DIR, load_model_spec
    from toolkit.spec.plan import resolve_plan

    preset, seq_len, tiled = LONG_CONTEXT_CASES[name]
    spec = load_model_spec(preset)
    plan = resolve_plan(spec, 1, zero=0, seq_len=seq_len, micro_batch=1, recompute="full", tiled_mlp=tiled,
                        tiled_loss=tiled, gpus_per_node=1)
    memory = estimate_memory(spec, plan)
    setup = activation_setup(spec, plan)
    config = AutoConfig.from_pretrained(PRESET_DIR / f"{preset}.json")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, config.vocab_size, (1, seq_len), device="cuda")
    mlp_shards = mlp_tiles(spec, setup)

    def tiled_mlp(self, x):  # the patch DeepSpeed's TiledMLP docstring gives for LlamaMLP
        return TiledMLP.apply(lambda mlp, t: mlp.down_proj(mlp.act_fn(mlp.gate_proj(t)) * mlp.up_proj(t)), self, x,
                              mlp_shards, [])

    def tiled_loss(hidden, labels):  # TiledFusedLogitsLoss over the shifted labels, as ALST computes the loss
        def loss_fn(owner, x, y):
            logits = owner.lm_head(x).float()
            return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))

        # `model` is the enclosing function's, deleted below only after this has run
        return TiledFusedLogitsLoss.apply(loss_fn, model, hidden[:, :-1], labels[:, 1:], None,  # noqa: F821
                                          loss_tiles(spec, setup), [model.lm_head.weight], "mean")  # noqa: F821

    original = modeling_llama.LlamaMLP.forward
    if tiled:
        modeling_llama.LlamaMLP.forward = tiled_mlp
    try:
        torch.cuda.synchronize()
        weights = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        started = time.time()
        if tiled:
            loss = tiled_loss(model.model(input_ids=ids).last_hidden_state, ids)
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        wall_s = time.time() - started
        peak = torch.cuda.max_memory_allocated() - weights
    finally:
        modeling_llama.LlamaMLP.forward = original
    gradients = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    # the estimate's two peaks for this bare run (no optimizer, no DeepSpeed buffers, its own bf16 gradients): the
    # loss's (toolkit/estimate/memory.py loss_peak_bytes: before any gradient exists) and the layers' backward
    transients = {k: v for k, v in memory.overhead_detail.items() if k not in OUTSIDE_ALLOCATED + ("head_backward",)}
    head = loss_peak_bytes(spec, plan)
    layers = memory.activations + sum(transients.values()) + gradients
    predicted = max(head, layers)
    del model, loss
    torch.cuda.empty_cache()
    return {"case": name, "preset": preset, "seq_len": seq_len, "tiled_mlp": tiled, "tiled_loss": tiled,
            "mlp_tiles": mlp_shards if tiled else None, "loss_tiles": loss_tiles(spec, setup) if tiled else None,
            "wall_s": round(wall_s, 2), "measured_peak_above_weights": peak, "run_gradients": gradients,
            "predicted_activations": memory.activations, "predicted_transients": transients,
            "predicted_loss_peak": head, "predicted_layers_peak": layers,
            "predicted_peak_above_weights": predicted, "memory_error": predicted / peak - 1}


# one Llama 3.1 8B decoder layer as Megatron-Core's Transformer Engine spec builds it (LayerNormLinear for qkv and fc1,
# Linear for the projection and fc2, fused attention and SwiGLU in bf16 between them), at 8K tokens
FP8_CASE = ("llama-3.1-8b", 8192)


def fp8_case(recipe_name: str) -> dict:
    """One forward and backward of that layer in bf16 and under the fp8 recipe, each against
    `torch.cuda.max_memory_allocated()`: the bytes the forward leaves saved for backward and the bytes the recipe's
    weight copies add (is_first_microbatch=True caches them, as Megatron-Core asks), beside the estimate's terms
    (toolkit/estimate/activations.py, toolkit/spec/quantization.py)."""
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    from toolkit.estimate.activations import _block_bytes_per_token
    from toolkit.estimate.memory import activation_setup
    from toolkit.spec.model import load_model_spec
    from toolkit.spec.plan import resolve_plan
    from toolkit.spec.quantization import RECIPES

    preset, tokens = FP8_CASE
    spec = load_model_spec(preset)
    h, ffn = spec.hidden_size, spec.ffn_hidden_size
    heads, kv, d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    recipes = {"delayed": te_recipe.DelayedScaling, "tensorwise": te_recipe.Float8CurrentScaling,
               "blockwise": te_recipe.Float8BlockScaling, "mxfp8": te_recipe.MXFP8BlockScaling}
    with torch.device("cuda"):
        qkv = te.LayerNormLinear(h, (heads + 2 * kv) * d, bias=False, normalization="RMSNorm", params_dtype=torch.bfloat16)
        proj = te.Linear(heads * d, h, bias=False, params_dtype=torch.bfloat16)
        fc1 = te.LayerNormLinear(h, 2 * ffn, bias=False, normalization="RMSNorm", params_dtype=torch.bfloat16)
        fc2 = te.Linear(ffn, h, bias=False, params_dtype=torch.bfloat16)
        attention = te.DotProductAttention(heads, d, num_gqa_groups=kv, attn_mask_type="causal", qkv_format="sbhd")
    gemm_params = sum(p.numel() for m in (qkv, proj, fc1, fc2) for n, p in m.named_parameters() if "weight" in n
                      and "layer_norm" not in n)

    def layer(x, first: bool):
        q, k, v = qkv(x, is_first_microbatch=first).split([heads * d, kv * d, kv * d], dim=-1)
        out = attention(q.reshape(tokens, 1, heads, d), k.reshape(tokens, 1, kv, d), v.reshape(tokens, 1, kv, d))
        x = x + proj(out.reshape(tokens, 1, heads * d), is_first_microbatch=first)
        gate, up = fc1(x, is_first_microbatch=first).chunk(2, dim=-1)
        return x + fc2(torch.nn.functional.silu(gate) * up, is_first_microbatch=first)

    measured = {}
    for precision in ("bf16", recipe_name):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()  # the layer's input counts as the estimate counts it (kept by qkv's norm)
        x = torch.randn(tokens, 1, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.reset_peak_memory_stats()
        with te.fp8_autocast(enabled=precision != "bf16", fp8_recipe=recipes.get(recipe_name, te_recipe.DelayedScaling)()):
            y = layer(x, first=True)
        torch.cuda.synchronize()
        saved = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        y.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        measured[precision] = {"after_forward": saved, "peak": torch.cuda.max_memory_allocated() - before}
        del x, y
        for module in (qkv, proj, fc1, fc2):
            module.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    plans = {p: resolve_plan(spec, 1, backend="megatron", zero=0, seq_len=tokens, gpus_per_node=1,
                             **({"precision": "fp8", "fp8_recipe": recipe_name} if p != "bf16" else {}))
             for p in measured}
    # the layer's saved activations (its output aside) and, under fp8, the weight copies the first micro-batch caches
    predicted = {p: _block_bytes_per_token(spec, False, activation_setup(spec, plan)) * tokens
                 + (gemm_params * RECIPES[recipe_name].weight_copy_bytes if p != "bf16" else 0)
                 for p, plan in plans.items()}
    return {"case": f"{preset} layer, {tokens} tokens, {recipe_name}", "gemm_params": gemm_params,
            "measured_after_forward": {p: m["after_forward"] for p, m in measured.items()},
            "measured_peak": {p: m["peak"] for p, m in measured.items()}, "predicted_after_forward": predicted,
            "errors": {p: predicted[p] / measured[p]["after_forward"] - 1 for p in measured}}


# torch context parallel on FSDP2 (plan cp=2) against one rank without it: it cannot run on CPU ranks (torch has no
# context-parallel attention for CPU SDPA, toolkit/backends/fsdp/train.py), so this is where it is checked
CONTEXT_PARALLEL_LOSS_TOLERANCE = 2e-2  # bf16 with another reduction order (ring all-gather of keys and values)


def context_parallel_case(work: Path, corpus: Path, gpu: str, steps: int) -> dict:
    """A small Llama trained with plan cp=2 on 2 GPUs and with cp=1 on one: per-step losses within the tolerance."""
    if __import__("torch").cuda.device_count() < 2:
        return {"case": "fsdp-context-parallel", "skipped": "needs 2 GPUs (cp=2)"}
    runs = {}
    for cp in (1, 2):
        case_dir = work / f"fsdp-cp{cp}"
        shutil.rmtree(case_dir, ignore_errors=True)
        case_dir.mkdir(parents=True)
        recipe = case_dir / "recipe.yaml"
        recipe.write_text("\n".join([
            f"name: fsdp-cp{cp}", "model: {source: llama-3.2-1b}",
            f"data: {{train_files: [{corpus}], eval_fraction: 0.0, tokenizer: {{vocab_size: 512}}}}",
            f"cluster: {{gpus: {cp}, gpus_per_node: {cp}, gpu: {gpu}, accelerator: gpu}}",
            f"training: {{seq_len: 8192, global_batch: 1, max_steps: {steps}, learning_rate: 1.0e-4, logging_steps: 1, "
            f"save_steps: 0}}",
            f"plan: {{backend: fsdp, micro_batch: 1, precision: bf16, recompute: full, cp: {cp}}}"]) + "\n")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cp), "--master_port",
                   "29512", "--module", "toolkit.train", "--recipe", str(recipe), "--output-dir",
                   str(case_dir / "run")]
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        metrics = case_dir / "run" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        runs[cp] = {"rc": proc.returncode, "losses": [r["loss"] for r in rows if "loss" in r],
                    "error": None if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]}
    pairs = list(zip(runs[1]["losses"], runs[2]["losses"]))
    worst = max((abs(a - b) / abs(a) for a, b in pairs), default=None)
    return {"case": "fsdp-context-parallel", "runs": runs, "worst_relative_loss_difference": worst,
            "equal": worst is not None and len(pairs) == steps and worst <= CONTEXT_PARALLEL_LOSS_TOLERANCE}


def gemm_table(gpu_name: str) -> list[dict]:
    import torch

    from toolkit.estimate.efficiency import gemm_efficiency
    from toolkit.spec.cluster import get_gpu

    peak = get_gpu(gpu_name).peak_tflops["bf16"] * 1e12
    rows = []
    for hidden in (1024, 2048, 4096, 8192, 16384):
        for tokens in (512, 4096, 16384):
            a = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(hidden, 4 * hidden, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                a @ b
            torch.cuda.synchronize()
            iters = 20
            start = time.perf_counter()
            for _ in range(iters):
                a @ b
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / iters
            achieved = 2 * tokens * hidden * 4 * hidden / seconds
            rows.append({"hidden": hidden, "tokens": tokens, "tflops": achieved / 1e12,
                         "fraction_of_peak": achieved / peak, "model_efficiency": gemm_efficiency(hidden, 1, tokens)})
            del a, b
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpu", default="h100-80gb", help="catalogue name of the GPU this runs on")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--skip-health", action="store_true")
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--long-context", action="store_true",
                        help="the long-context check: activation peak with and without DeepSpeed's tiles")
    parser.add_argument("--context-parallel", action="store_true",
                        help="also train plan cp=2 (FSDP2, torch context parallel) on 2 GPUs against cp=1 on one")
    parser.add_argument("--fp8", default=None, choices=("delayed", "tensorwise", "blockwise", "mxfp8"),
                        help="one fp8 forward and backward of a Llama 3.1 8B layer (Transformer Engine) against "
                             "torch.cuda.max_memory_allocated(), beside the estimate's saved activations and "
                             "weight copies")
    parser.add_argument("--profile", action="store_true",
                        help="profile two steps of the first case and read them through HTA (dmt report --breakdown)")
    parser.add_argument("--cross-validate", action="store_true",
                        help="re-predict every case with a calibration fitted on the other cases of its path")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; skipped (it runs on a GPU machine, never in make test)")
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.txt"
    corpus.write_text((REPO / "recipes" / "data" / "tiny_corpus.txt").read_text() * 40)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "gpu": args.gpu, "cases": []}
    if not args.skip_health:
        health_json = args.work / "health.json"
        proc = subprocess.run([sys.executable, "-m", "toolkit", "health", "--nproc", "1", "--output", str(health_json)],
                              cwd=REPO, capture_output=True, text=True)
        report["health_rc"] = proc.returncode
        report["health_output"] = (proc.stdout + proc.stderr)[-4000:]
        if health_json.is_file():
            report["health"] = json.loads(health_json.read_text())
    report["gemm"] = [] if args.skip_gemm else gemm_table(args.gpu)
    for index, name in enumerate(args.cases):
        result = run_case(name, args.work, corpus, args.gpu, args.steps, profile=args.profile and index == 0)
        report["cases"].append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("estimate",)}, default=str), flush=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
    if args.long_context:
        report["long_context"] = [long_context_case(name) for name in LONG_CONTEXT_CASES]
        args.out.write_text(json.dumps(report, indent=2, default=str))
    if args.fp8:
        report["fp8"] = fp8_case(args.fp8)
        print(json.dumps(report["fp8"], default=str), flush=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
    if args.context_parallel:
        report["context_parallel"] = context_parallel_case(args.work, corpus, args.gpu, args.steps)
        print(json.dumps({k: v for k, v in report["context_parallel"].items() if k != "runs"}), flush=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
    if args.cross_validate:
        from calibration_cpu import leave_one_out

        runs = {r["case"]: Path(r["run_dir"]) for r in report["cases"] if "run_dir" in r}
        report["leave_one_out"] = {name: {"measured_step_s": r["measured"]["step_time_s"],
                                          "predicted_step_s": r["predicted"]["step_time_s"],
                                          "error": r["error"]["step_time"], "calibration": r["calibration"]}
                                   for name, r in leave_one_out(runs, args.work).items()}
    args.out.write_text(json.dumps(report, indent=2, default=str))
    for name, row in report.get("leave_one_out", {}).items():
        print(f"{name}: calibrated on the other cases of its path: step {row['measured_step_s']:.3f} s vs "
              f"{row['predicted_step_s']:.3f} s ({row['error']:+.1%})")
    for row in report["gemm"]:
        print(f"gemm h={row['hidden']:>5} tokens={row['tokens']:>5}: {row['tflops']:6.0f} TFLOP/s "
              f"= {row['fraction_of_peak']:.2f} of peak; model {row['model_efficiency']:.2f}")
    for r in report.get("long_context", []):
        print(f"{r['case']}: peak above the weights {r['measured_peak_above_weights'] / GiB:.2f} GiB vs predicted "
              f"{r['predicted_peak_above_weights'] / GiB:.2f} GiB ({r['memory_error']:+.1%}; activations "
              f"{r['predicted_activations'] / GiB:.2f}, transients {sum(r['predicted_transients'].values()) / GiB:.2f}, "
              f"gradients {r['run_gradients'] / GiB:.2f}); {r['wall_s']} s")
    for r in report["cases"]:
        if r.get("breakdown"):
            print(f"{r['case']}: profiled steps ({r['breakdown']['source']}): {r['breakdown']['gap']}")
        if "measured_step_s" in r:
            print(f"{r['case']}: allocated {r['measured_max_allocated'] / GiB:.2f} GiB vs predicted "
                  f"{r['predicted_allocated'] / GiB:.2f} ({r['memory_error']:+.1%}); reserved "
                  f"{r['measured_max_reserved'] / GiB:.2f} vs {r['predicted_reserved'] / GiB:.2f} "
                  f"({r['reserved_error']:+.1%}); step {r['measured_step_s']:.3f} s "
                  f"vs {r['estimate']['step_time_s']:.3f} s ({r['time_error']:+.1%})")
        else:
            print(f"{r['case']}: failed rc={r['rc']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
