"""Predicted step time and plan rank against published training runs of every execution path.

Run: .venv/bin/python benchmarks/step_time_accuracy.py [--write benchmarks/step_time_accuracy.md]
Prints, for each reference row of benchmarks/step_time_references.yaml, the published step time (implied by the
published TFLOP/s or tokens/s per GPU where the source gives no step time), the predicted one, the error, and for the
Megatron-LM and Llama 3 rows where `dmt plan` ranks the published layout for that model and cluster; then the modern
H100 rows of each execution path (Megatron-Core + Transformer Engine, HF/eager modules under DeepSpeed and FSDP2,
Megatron-Core's local spec), and the published rows the model cannot reach yet, with the reason. Also times the full
search for Llama 3.1 405B on 16,384 H100s.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import time
from contextlib import redirect_stdout
from pathlib import Path

import yaml

from toolkit.errors import UserInputError
from toolkit.estimate import moe_timing
from toolkit.estimate.comm import Network
from toolkit.estimate.efficiency import EXECUTION_PATHS, execution_path
from toolkit.estimate.flops import model_flops_per_token
from toolkit.estimate.memory import estimate_memory
from toolkit.estimate.timing import STEP_COMPONENTS, step_time
from toolkit.planner.predict import recompute_label
from toolkit.planner.search import pipeline_splits, search
from toolkit.spec.cluster import get_gpu, topology_defaults
from toolkit.spec.model import ModelSpec, load_model_spec
from toolkit.spec.plan import resolve_plan

HERE = Path(__file__).resolve().parent
NOTES = """
Notes on the misses and on the Llama 3 layout:
- Llama 3 405B (TP8 PP16, 126 layers): the paper removes one layer from the first and the last stage and runs an
  interleaved schedule (arXiv:2407.21783 Sec. 3.3.2). In Megatron-Core that is account_for_embedding/loss_in_pipeline_split
  (num_layers_in_first/last_pipeline_stage = 7 cannot interleave: 7 and 8 have no common divisor > 1). The rows take
  the fastest V Megatron-Core accepts (V = 8: one layer per chunk), since the paper gives none.
- The same 8K layout does not fit 80 GiB in the model without recomputation: rank 1 keeps 15 micro-batches x 8 layers
  alive under 1F1B (82 GiB) and more with interleaving (Megatron's warm-up 2(p-r-1) + (V-1)p: 87 GiB at 16,384 GPUs,
  94 GiB at 8,192). With only 16 (8) micro-batches per pipeline at DP 128 (64), Megatron-Core's schedules keep every
  forward alive, and they allow no microbatch_group_size_per_vp_stage below pp (schedules.py); the paper's own
  schedule trained 8K sequences without activation checkpointing. So in Megatron-Core this layout must recompute: its
  cheapest recomputation (columns above; Megatron-Core's selective MLP or the block method) costs ~30% and ranks it
  in the top third. The plans ranked above it are mostly the same TP8/PP16-32 family with CP 2-4: CP multiplies the
  micro-batches per pipeline by CP, which cuts the interleaved bubble (p-1)/(V m) and the warm-up memory together.
- Rank counts each layout once (its fastest recomputation that fits); "slower than the winner" is the predicted step
  of the published layout's best plan over the best plan's.
- Llama 3 405B at 128K (CP16): under-predicted by 20%. 57% of this step's model FLOPs are attention (counted over
  the full s x s matrix, PaLM convention). The model runs the causal half at half the GEMM efficiency
  (ATTENTION_KERNEL_EFFICIENCY in toolkit/estimate/attention_rate.py: FlashAttention-2 forward + backward on H100 reaches
  ~335 TFLOP/s, arXiv:2307.08691, against ~60% of peak for large GEMMs) and hides the ring exchange behind it: 48%
  MFU predicted against the published 38% (it was -40% and 64% while attention ran at GEMM efficiency). The rest
  may be the ring exchange, which is not perfectly hidden, and the paper does not say whether its TFLOP/s count the
  causal half (which would shrink the published step by 30%).
- The Megatron GPT rows (Table 1) and the held-back Table 2 rows: "we use the interleaved pipeline schedule with the
  scatter/gather optimization enabled" (arXiv:2104.04473 Sec. 5.1). The rows ran 1F1B with whole activations
  between stages here until now, and the deep ones (PP 35 and 64) were +12.9% and +12.3% with the rest within 11%:
  their 1F1B bubble, (p-1) micro-batches of 2-3 layers against 280-512, was 10% of the step. Run as the paper says
  (the fastest V Megatron-Core accepts, since the paper gives none; the inter-stage activations 1/t a rank, what
  sequence parallelism sends between stages as scatter/gather did; micro-batch 1): +4.0% and +4.9%. The pipeline
  terms were checked against Megatron-Core's own schedules, run rank by rank with a recording transport
  (toolkit/compat/megatron_schedule_trace.py) and replayed with unequal chunks and transfer times
  (tests/unit/test_pipeline_schedule.py): the bubble is the other stages' (p-1)/v micro-batches, a rank waits for
  2v exchanges a micro-batch (one batched call after each forward-backward pair of chunks sends an activation on and
  a gradient back over the same link), within 1.5% of the replay. What the schedule showed wrong is the
  data-parallel term: chunk c's gradient reduction starts after its last backward with c x pp backwards still to
  run on the first rank, so only the first chunk's is exposed (toolkit/estimate/timing.py exposed_after_cooldown):
  -0.4 s on the 530B row. The shallow rows moved by a few points with interleaving (76.1B +0.8% -> -4.4%, 145.6B
  +3.0% -> -4.3%, 310.1B +6.5% -> -2.5%): all within 5%. Held back (no constant set from them): Table 2's PTD-P
  rows (GPT-3 175B at p 12 and the 530B at p 35 on 1x-4x the GPUs: -7.4% to +5.5%) and MT-NLG's runs of the same
  530B layout under DeepSpeed's 1F1B pipeline engine, which cannot interleave at 160-240 micro-batches (not a
  multiple of 35) and are under-predicted by 11-15% (126 TFLOP/s per GPU against 159-171 for Megatron-LM's runs of
  that layout): that engine is slower than Megatron-LM's, which the model does not describe. The Llama 3 8K rows
  moved from -4% to -6% and -8% with the same data-parallel term (their distributed optimizer's reduce-scatter and
  all-gather, chunk by chunk under the cooldown).
- The 1.7B row (TP 1: its data-parallel group of 32 spans 4 nodes with all 8 GPUs of each) moved from -2% to -18%
  when rings across nodes began to use every NIC of a node (toolkit/estimate/comm.py: 8 x 25 GB/s HDR per DGX A100
  instead of one): its gradient all-reduce is now ~0.1 s. The model is faster than the paper's run: its narrow
  GEMMs (hidden 2304) ran below the width curve, or its all-reduce across 4 nodes took longer than the NICs allow;
  the paper does not break the step down.
- Execution paths (toolkit/estimate/efficiency.py). megatron-te: the Megatron-LM, Llama 3 and Megatron-Bridge rows.
  The Bridge rows use Transformer Engine's TP communication overlap (userbuffers), which the toolkit's generated
  configs do not enable and the model does not credit (16% of the 70B FP8 step is TP all-reduces here). FP8 runs the
  GEMMs at the fp8 peak times the same curve and attention at bf16's, as Transformer Engine does with
  fp8_dot_product_attention off (Bridge's recipes): the FP8 rows moved from -3%, +2% and +1% (attention at the fp8
  peak) to +6%, +7% and +9%, the TP overlap not credited being the likeliest rest. The MoE rows are below, with their
  dispatchers (HybridEP and DeepEP are --moe-dispatcher flex).
- The 70B and 405B FP8 rows were "fits: False" (83.0 GiB and over 79.1 GiB on rank 0): three terms were too large, none of
  them the interleaved schedule's in-flight count, which is Megatron-Core's own (2(p-r-1) + (v-1)p warm-up forwards,
  47 chunks of 2 layers on rank 0: get_pp_rank_microbatches in schedules.py, replayed in tests/unit/
  test_pipeline_schedule.py). (1) Bridge's fp8_cs recipe is tensorwise with fp8_param_gather
  (perf_recipes/_common.py, training/mixed_precision.py): the GEMM weights are fp8 tensors, no bf16 copy beside them
  (-2.2 GiB on rank 0; the rows now say so). (2) Transformer Engine saves each GEMM's input for the weight gradient
  quantized, column-wise only (module/linear.py "Discard row-wise data"): the norms' outputs and fc2's input cost a
  byte, not two, while the output projection adds its own fp8 copy beside attention's bf16 output (-13% of the
  activations: 49.3 -> 42.6 GiB). (3) The bf16-plus-fp8 weights were counted at 3 B/param; they are 4 on Hopper (the
  fp8 copy and its transpose, cached across micro-batches: Megatron-Core passes is_first_microbatch), which (1)
  removes. Rank 0 of the 70B row: 73.7 GiB of 79.1 (69.0 since the row states Bridge's bf16 gradients, below).
- hf: HF or eager PyTorch modules. The eager rate (0.57 of the fused one) fits torchtitan's one-node Llama 3.1 8B row
  and the toolkit's own DeepSpeed run on one H100 alike (+1% each); torchtitan's machines were Grand Teton H100s
  with 96 GB of HBM2e at 2.4 TB/s and a 500 W power limit, with selective (op) activation checkpointing (82.4 GiB:
  "fits" is False for an 80 GB H100), which make that row slower than an H100 SXM at 700 W, so the rate is if
  anything conservative for the HF Trainer on SXM parts. NeMo AutoModel's Llama 3 70B row runs HF model code with
  Transformer Engine's kernels and torch.compile, so it is predicted on the fused rate; its CP 2 under FSDP2 is
  outside the fsdp backend's rules and is patched into the plan for the step model only.
- Context parallelism (toolkit/estimate/timing.py): each ring step's wait (the link's per-hop latency) and its
  memory-bound merge of partial results (fp32 output and log-sum-exp forward, fp32 dq and dk/dv backward) are on the
  critical path, and fused attention runs the seq/(2 cp) blocks of the load-balanced ring at FlashAttention-3's
  published rate for that length (arXiv:2407.08608 Fig. 5). `dmt plan --model llama-3.1-70b --gpus 64 --global-batch
  256 --seq-len 8192 --precision fp8 --backends megatron` ranked tp2 pp8 cp4 15% faster than Bridge's tuned
  tp4 pp8 vpp5 (the row above); now 10.8% (17.2 s against 19.1 s; the Llama 3 128K row moved from -20.3% to -17.5%),
  and `dmt plan --explain` names the rest: 1.96 s less TP and 0.98 s less PP communication, which the Bridge run
  overlaps (Transformer Engine's TP communication overlap) and the toolkit's generated configs do not.
- megatron-local: Megatron-Core's local spec without Apex: the eager rate plus the unfused attention's memory
  traffic, counted per score element from Megatron-Core 0.16.1's code (UNFUSED_ATTENTION_*_BYTES): -5% (the model
  had it 3.9x too fast before the paths).
"""

PRECISION_NOTES = """
How a precision enters the step (toolkit/estimate/timing.py, toolkit/spec/quantization.py): the GEMMs run at the
recipe's peak (the catalogue's mxfp8 / nvfp4 key where the part lists one, else its fp8 key) times the same width
curve as bf16; attention (Transformer Engine's fused kernel in bf16: Megatron-Core's fp8_dot_product_attention is off
in every Bridge recipe), the norms and every collective at bf16 rates; with fp8_param_gather the distributed
optimizer all-gathers the GEMM weights in fp8. Not modelled: the quantization kernels themselves (amax and cast of
every GEMM input and output gradient, one layout for tensorwise on Blackwell, two with their scales for mxfp8 and
nvfp4), which is why the tensorwise/mxfp8 pairs are predicted equal where Bridge measured mxfp8 2-6% slower.

BF16 against FP8 (the question a user choosing a precision asks). Megatron-Bridge's summaries publish no dense pair
(their one same-layout BF16/FP8 pair, DeepSeek-V3 on 256 GB300 in 25.11, ran a layout no Bridge config of that time
holds, so its other settings cannot be read; not added) and the NeMo framework's summaries read (24.07, 24.12,
25.02, 25.04, 25.07) publish FP8 only; NVIDIA's DGX Cloud Benchmarking recipes (NVIDIA/dgxc-benchmarking, release
tags v25.02-v25.05) publish seconds per step of both precisions on one layout, which the pairs take as published.
Their FP8 is NeMo's: delayed scaling with fp8_params (the yaml says per release); both precisions run userbuffers TP
overlap. torchtitan's Llama 3.1 8B runs (FSDP2 + torch.compile, without and with torchao's Float8, dynamic
tensorwise) are the same question on another stack. No constant was set from these pairs.
- The 405B pairs (H100 and GB200) predict the ratio within 2%; Llama 3.1 8B (-18%) and 70B (-13%) on H100 predict
  more FP8 speedup than measured (1.60x each against 1.32x and 1.40x). The 8B pair is TP 1 with no pipeline: its
  predicted step is compute and CP's exchange alone (13.1 -> 8.05 s of compute), so the miss is in how FP8 GEMMs are
  priced, not in communication. torchtitan's two 8B pairs, another stack (torchao's casts, compiled), miss the same
  way (-21%: 1.63x predicted against 1.28-1.29x), and their rows' own errors are the compile the model does not
  describe (the hf execution path's rate is the eager one), not the ratio, which the execution path does not move.
- First term responsible, read in Transformer Engine's code: the quantization kernels. Under delayed (and
  tensorwise) scaling on Hopper every GEMM input and every output gradient is cast to fp8 with a transposed copy for
  the other GEMM (module/linear.py and layernorm_linear.py: the fused cast-transpose of the input, the layernorm's
  fp8 output transposed for the weight gradient; backward: grad_output cast-transpose, bgrad/dact fused), which
  reads 2 bytes an element and writes 1 + 1. For the 8B that is ~262 kB per token and layer (attention output,
  SwiGLU output, the QKV, proj, fc1 and fc2 output gradients at 4 bytes, the two norms' outputs at 2): 1.1 TB per
  GPU a step, ~0.47 s at the model's memory-bound rate (HBM_EFFICIENCY), which moves the 8B ratio from 0.624 to
  ~0.658 (ratio error -18% -> -13%). Its share falls as 1/hidden (elements grow with h, GEMM work with h^2), which
  is why the 405B pairs (h 16384) do not show it as much. Not added to the model yet: it changes every FP8 row, the
  MoE rows' fitted constant included, and belongs with the cast traffic of the block recipes above (one change,
  checked against TE's kernels).
- The rest (the 8B's ratio error after the casts, ~13%) is, likeliest, the FP8 GEMMs' rate: the model runs them at
  twice the bf16 rate on bf16's width curve. Whether H100's fp8 GEMMs reach the same fraction of their peak as
  bf16's at these widths (K 4096-14336) is not measured here (benchmarks/gpu_check.md measured bf16 only); a
  GEMM-rate measurement of both precisions on one part is what would ground a change, not these rows.
- The 405B agreement is in part two errors cancelling: the model does not credit the TP communication overlap both
  runs used and adds the same TP all-reduces to both steps (2.96 s on H100, 0.63 s on GB200; 1.59 s for the 70B),
  which dilutes the predicted speedup. Without them the predicted ratios would be 0.559 and 0.619 (405B H100, GB200)
  and 0.582 (70B): every BF16/FP8 pair over-predicts the FP8 speedup, by 6-21%, consistent with the two unmodelled
  costs above.
- Memory: the BF16 runs of the 8B and 405B pairs ran, but were estimated 0.6-4.4 GiB over the part ("fits" False),
  and so was Bridge's 405B MXFP8 run on 256 GB200 (+1.2 GiB). One term was too large for what they ran: the
  gradients. Megatron-Core's main-grad buffers take the parameters' dtype unless grad_reduce_in_fp32
  (distributed_data_parallel.py: grad_dtype = torch.float if grad_reduce_in_fp32 else param.dtype), and every rank
  keeps them whole; the model counted fp32, while NeMo's performance recipes (pretrain_performance_optimizations:
  plugins.grad_reduce_in_fp32 = False, which MegatronStrategy copies into the DDP config; the FP8 scripts set it
  again) and Bridge's (set_llama3(1)_common_configs: ddp.grad_reduce_in_fp32 = False) reduce in bf16, in both
  precisions. The plan now says so (--grad-reduce-in-bf16, Megatron-LM's flag) and these rows state it: 2 B/param
  less (8B on H100: 80.6 -> 64.9 GiB; 405B on 512 H100: 83.5 -> 71.0 GiB; 405B on 128 GB200: 184.9 -> 160.0 GiB;
  405B MXFP8 on 256 GB200: 185.5 -> 173.1 GiB), and each now fits. A measurement agrees: the sample log line of
  dgxc-benchmarking v25.04's llama3.1/README.md (an 8B run on 8 H100, GBS 128, 12.39 s a step) has 41.2 GiB
  allocated after the step (the estimate's weights, bf16 gradients and optimizer shards: 41.1; with fp32 gradients
  56.1) and 66.0 GiB reserved at the peak (the estimate, less the CUDA context: 64.2, 2.7% under), so no other term
  (the activations under TE's fused kernels, the 5% allocator margin) is too large for that run. The rest was read
  and is as the runs set it: no recomputation or offloading (NeMo's recommended configs: recompute_layers and
  activation_offload_layers 0; DGX Cloud's launch scripts set neither), the 405B split with
  account_for_embedding/loss_in_pipeline_split (NeMo's llama31_405b recipe, the rows' fastest split), the warm-up
  forwards Megatron-Core's schedule keeps (69 chunks of 2 layers on the 405B's rank 1: 2(p-r-1) + (v-1)p + 1), the
  optimizer sharded over dp x cp, no fp8 weight copies in the BF16 runs, and v25.05's use_precision_aware_optimizer
  (BF16), whose default fp32 states cost what the distributed optimizer's do.
  v25.02's 70B pair (NeMo 1, Apex's distributed_fused_adam with grad_sync_dtype bf16) states nothing: its buffers are
  Apex's, which the megatron backend does not describe, and it fits either way. The torchtitan runs remain "fits"
  False: they ran on 96 GB parts with selective (op) activation checkpointing, which the rows take as none.
"""


def megatron_gpt(heads: int, hidden: int, layers: int, vocab: int, seq: int) -> ModelSpec:
    """The GPT architecture of the Megatron-LM paper: 4h GELU MLP, LayerNorm, learned positions, biases, tied head."""
    return ModelSpec(
        name=f"gpt-h{hidden}-l{layers}", family="megatron-gpt", num_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, ffn_hidden_size=4 * hidden,
        vocab_size=vocab, max_position_embeddings=seq, tie_embeddings=True, activation="gelu", norm="layernorm",
        position_embedding="learned", position_embedding_rows=seq, qkv_bias=True, attn_out_bias=True, mlp_bias=True,
    )


def published_layout_rank(model, gpus, gpu, network, layout: dict, **fixed) -> tuple[int | None, int, float, str]:
    """(rank of the best plan with the published layout, plans that fit, its step time over the winner's - 1, how
    it recomputes)."""
    result = search(model, gpus, gpu, network, ("megatron",), **fixed)
    best = result.ranked[0].time.total_s
    for rank, candidate in enumerate(result.ranked, 1):
        if all(getattr(candidate.plan, key) == value for key, value in layout.items()):
            return rank, len(result.ranked), candidate.time.total_s / best - 1, recompute_label(candidate.plan)
    return None, len(result.ranked), float("nan"), ""


def network_for(gpu) -> Network:
    return Network.from_catalogue(gpu, 8)


def megatron_rows(refs: dict) -> list[dict]:
    """Megatron-LM's GPT runs. With `interleaved` (arXiv:2104.04473 Sec. 5.1: "the interleaved pipeline schedule with
    the scatter/gather optimization"), the fastest V Megatron-Core accepts where pp > 1 (the paper gives none) and the
    inter-stage activations 1/t a rank (what sequence parallelism sends between stages, as scatter/gather did);
    otherwise 1F1B with whole activations."""
    gpu = get_gpu(refs["gpu"])
    seq, vocab = refs["seq_len"], refs["vocab_size"]
    interleaved = refs.get("interleaved", False)
    rows = []
    for params_b, heads, hidden, layers, tp, pp, gpus, batch, figure in refs["rows"]:
        model = megatron_gpt(heads, hidden, layers, vocab, seq)
        options = dict(backend="megatron", tp=tp, pp=pp, micro_batch=1, global_batch=batch, seq_len=seq,
                       recompute="full", gpus_per_node=8, sequence_parallel=interleaved and tp > 1)
        vpps = next(v for split, v in pipeline_splits(layers, pp, True) if not split) if interleaved and pp > 1 else [1]
        predicted, plan = min(((step_time(model, plan, gpu, network_for(gpu)), plan)
                               for plan in (resolve_plan(model, gpus, vpp=vpp, **options) for vpp in vpps)),
                              key=lambda v: v[0].total_s)
        # Eq. 3 of arXiv:2104.04473: FLOPs per iteration, recomputation included
        flops = 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
        # Tables 1 and 2 give TFLOP/s per GPU; the MT-NLG block gives the iteration time itself
        published = figure if refs.get("published") == "step_s" else flops / (figure * 1e12 * gpus)
        rank, fitting, gap, how = published_layout_rank(model, gpus, gpu, network_for(gpu), dict(tp=tp, pp=pp, cp=1),
                                                        seq_len=seq, global_batch=batch, recompute="full",
                                                        distributed_optimizer=False,
                                                        sequence_parallel=options["sequence_parallel"])
        schedule = f" v{plan.vpp}" if interleaved and pp > 1 else ""
        rows.append(dict(name=f"GPT {params_b}B t{tp} p{pp}{schedule} on {gpus} A100", published_s=published,
                         predicted_s=predicted.total_s, fits=estimate_memory(model, plan).total <= gpu.memory_bytes,
                         rank=rank, fitting=fitting, gap=gap, how=how, source=refs["source"]))
    return rows


def llama_rows(refs: dict) -> list[dict]:
    """The published layout as the paper states it (no activation checkpointing, one layer fewer on the first and
    last stage, interleaved); the paper gives no V, so the fastest of the V values Megatron-Core accepts is taken."""
    gpu = get_gpu(refs["gpu"])
    model = load_model_spec(refs["model"])
    rows = []
    for gpus, tp, cp, pp, dp, seq, batch, tflops, mfu in refs["rows"]:
        variants = []
        for split, vpps in pipeline_splits(model.num_layers, pp, megatron=True):
            for vpp in vpps:
                plan = resolve_plan(model, gpus, backend="megatron", tp=tp, cp=cp, pp=pp, vpp=vpp, micro_batch=1,
                                    global_batch=batch, seq_len=seq, recompute="none", distributed_optimizer=True,
                                    sequence_parallel=True, **split)
                variants.append((step_time(model, plan, gpu, network_for(gpu)).total_s, plan))
        predicted_s, plan = min(variants, key=lambda v: v[0])
        assert plan.dp == dp, (plan.dp, dp)
        published = model_flops_per_token(model, seq) * batch * seq / (tflops * 1e12 * gpus)
        rank, fitting, gap, how = published_layout_rank(model, gpus, gpu, network_for(gpu), dict(tp=tp, pp=pp, cp=cp),
                                                        seq_len=seq, global_batch=batch)
        rows.append(dict(name=f"Llama 3 405B t{tp} c{cp} p{pp} v{plan.vpp} d{dp} s{seq} on {gpus} H100",
                         published_s=published, predicted_s=predicted_s,
                         fits=estimate_memory(model, plan).total <= gpu.memory_bytes,
                         rank=rank, fitting=fitting, gap=gap, how=how, source=refs["source"]))
    return rows


def path_rows(refs: dict) -> list[dict]:
    """Modern H100 rows: the published layout resolved as a toolkit plan (the fastest VPP split where pp > 1), any
    layout the toolkit's rules do not offer patched in, evaluated on the reference's kernels."""
    gpu = get_gpu(refs["gpu"])
    rows = []
    for ref in refs["rows"]:
        model = load_model_spec(ref["model"])
        options = dict(ref["plan"])
        vpp = options.pop("vpp", 1)
        splits = pipeline_splits(model.num_layers, options["pp"], megatron=True) if options.get("pp", 1) > 1 else [({}, [1])]
        plans = [resolve_plan(model, ref["gpus"], vpp=vpp, **split, **options) for split, vpps in splits if vpp in vpps]
        plans = [plan.model_copy(update=ref.get("outside_rules", {})) for plan in plans]
        path = EXECUTION_PATHS[ref["path"]] if "path" in ref else None
        predicted_s, plan = min(((step_time(model, plan, gpu, network_for(gpu), path).total_s, plan) for plan in plans),
                                key=lambda v: v[0])
        published = ref.get("published") or (plan.global_batch * plan.seq_len
                                              / (ref["tokens_per_s_per_gpu"] * plan.gpus))
        kernels = (path or execution_path(plan)).name
        patched = ", ".join(f"{k} {v}" for k, v in ref.get("outside_rules", {}).items())
        rows.append(dict(name=ref["name"], published_s=published, predicted_s=predicted_s,
                         fits=estimate_memory(model, plan).total <= gpu.memory_bytes, rank=None, fitting=None,
                         gap=None, how=f"{kernels}{f'; outside the rules: {patched}' if patched else ''}",
                         source=ref["source"]))
    return rows


def fastest_split(model, gpus: int, gpu, options: dict):
    """(step s, plan) of a published layout: the fastest pipeline split Megatron-Core accepts at its VPP."""
    options = dict(options)
    vpp = options.pop("vpp", 1)
    splits = pipeline_splits(model.num_layers, options["pp"], megatron=True) if options.get("pp", 1) > 1 else [({}, [1])]
    plans = [resolve_plan(model, gpus, vpp=vpp, **split, **options) for split, vpps in splits if vpp in vpps]
    return min(((step_time(model, plan, gpu, network_for(gpu)).total_s, plan) for plan in plans), key=lambda v: v[0])


def precision_pairs(refs: list[dict]) -> None:
    """The same layout in two precisions: each row's error, and the error of the predicted ratio of step times."""
    print("\n## Precision pairs: the same layout in two precisions\n")
    print("Each pair ran one layout in two precisions (one release, one system); `ratio` is the second run's step time "
          "over the first's.\n")
    print("| layout | precisions | published step s | predicted step s | errors | published ratio | predicted ratio | "
          "ratio error | fits | source |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|")
    errors, bf16_errors, waiting = [], [], []
    for ref in refs:
        try:
            gpu = get_gpu(ref["gpu"])
        except UserInputError:
            waiting.append(ref)
            continue
        model = load_model_spec(ref["model"])
        published, predicted, fits, names = [], [], [], []
        for run in ref["runs"]:
            options = {**ref["plan"], **{k: v for k, v in run.items() if k not in ("tokens_per_s_per_gpu", "published")}}
            step, plan = fastest_split(model, ref["gpus"], gpu, options)
            # the step time where the source gives it, else from its tokens/s/GPU (never its model TFLOP/s)
            published.append(run.get("published") or plan.global_batch * plan.seq_len
                             / (run["tokens_per_s_per_gpu"] * plan.gpus))
            predicted.append(step)
            fits.append(str(estimate_memory(model, plan).total <= gpu.memory_bytes))
            names.append(plan.fp8_recipe or plan.fp4_recipe or plan.precision)
        ratio, predicted_ratio = published[1] / published[0], predicted[1] / predicted[0]
        errors.append(abs(predicted_ratio / ratio - 1))
        if names[0] == "bf16":
            bf16_errors.append(errors[-1])
        row_errors = " / ".join(f"{(p - q) / q:+.1%}" for p, q in zip(predicted, published))
        print(f"| {ref['name']} | {' / '.join(names)} | {published[0]:.3g} / {published[1]:.3g} | "
              f"{predicted[0]:.3g} / {predicted[1]:.3g} | {row_errors} | {ratio:.3f} | {predicted_ratio:.3f} | "
              f"{predicted_ratio / ratio - 1:+.1%} | {' / '.join(fits)} | {ref['source']} |")
    for ref in waiting:
        print(f"| {ref['name']} | - | - | - | - | - | - | - | - | {ref['source']}: no {ref['gpu']} in the catalogue |")
    print()
    for label, some in ((f"{len(errors)} pairs", errors), (f"{len(bf16_errors)} of them BF16 against FP8", bf16_errors)):
        if some:
            some = sorted(some)
            median = (some[(len(some) - 1) // 2] + some[len(some) // 2]) / 2
            print(f"{label}; ratio error median {median:.1%}, largest {some[-1]:.1%}")
    print(PRECISION_NOTES)
MOE_NOTES = """
Notes on the MoE rows:
- What the model prices per MoE layer (toolkit/estimate/moe_timing.py): the routed experts' GEMMs at the rate of one GEMM
  of the rows each local expert gets (TOKEN_SCALE, cited to DeepGEMM's published H800 table), the router, the
  memory-bound permutation, sort and activation traffic of the routed copies (routed_token_traffic_bytes, from
  Megatron-Core 0.16.1's moe_utils), and the dispatch and combine all-to-alls over EP, whose share bound for other
  nodes goes through each GPU's own NIC; the busiest EP rank sets the pace (--moe-imbalance, 1 here: the runs forced
  balanced routing, moe_router_force_load_balancing in Bridge's perf recipes).
- Each row runs the settings its release ran (Megatron-Bridge v0.4.2, the 26.04.01 container:
  scripts/performance/configs/<family>/*_workload_base_configs.py; step_time_references.yaml says which): the
  dispatcher (HybridEP or DeepEP is --moe-dispatcher flex), the EP all-to-all overlap (moe_a2a_overlap is
  --overlap-moe-expert-parallel-comm), the selective recompute modules, the fp8 recipe and DeepSeek-V3's pipeline
  layouts (Et*4|(t*4|)*14tmL at pp 8 vpp 2 and at pp 4 vpp 4, Bridge's own). Before these rows stated them the
  H100 rows were predicted 25-39% slow and DeepSeek-V3's could not be evaluated.
- Four mechanisms came with them: three read from the libraries' code and papers (nothing fitted), and one
  fitted constant (GPT-OSS's own five follow):
  (1) --overlap-moe-expert-parallel-comm, Megatron-Core's combined 1F1B schedule: one micro-batch's all-to-alls run
  on the communication stream beside another's forward or backward, so all but the unpaired passes (the first
  forward and last backward, or an interleaved first rank's warm-up and cool-down) hide their exchange behind the
  compute stream's work (expert_overlap_share). Qwen3 235B on H100 (EP 32 across 4 nodes): +39.0% -> -2.5% with
  the overlap alone, -2.1% with the rest.
  (2) The flex dispatcher's kernels (DeepEP, HybridEP) send a token across the network once per NVLink domain that
  holds one of its experts and fan it out over NVLink there (DeepSeek-V3 report, arXiv:2412.19437 Sec. 3.2.2; DeepEP
  README), where NCCL's all-to-all sends each copy (remote_domains_per_token): Qwen3 30B at EP 16 over 2 nodes
  sends 1.0 of a token across instead of 4 copies (ep comm 22.5 s -> 7.0 s).
  (3) The experts' gradients are reduced (and their optimizer shards gathered) over expert data parallelism, world /
  (pp x ep x etp) ranks ep x etp apart (Megatron-Core's expert RankGenerator), which with EP filling the node is one
  rank per node on its own NIC; the model reduced them with the dense parameters over every NIC of the node. GPT-OSS
  120B on 64 B200 (EP 8, 14 B expert parameters a rank, 5 micro-batches to hide them): dp comm 0.03 s -> 1.65 s.
  (4) MOE_LAYER_OVERHEAD_S, the one fitted constant (above): each MoE layer forward waits for the dispatcher's
  device-to-host copy of the tokens per expert (token_dispatcher.py _maybe_dtoh_and_synchronize), which drains the
  GPU's queue, and the host then launches the permutation, exchange and grouped GEMM while the GPU waits. With the
  overlap, the paired micro-batch's compute stream (these waits included) is what hides the all-to-all.
- GPT-OSS 120B, the one BF16 family (biased experts, heads of 64, 128-token windows on half the layers, YaRN), was
  predicted fast on all three systems (H100 -24.8%, GB200 -41.1%, B200 -17.1%). Five mechanisms read from the
  libraries' code and published kernel rates now price what sets it apart; nothing was fitted, and each row's move
  is given in points (H100 / GB200 / B200):
  (5) the experts' fc2 bias: Megatron-Core adds it outside the grouped GEMM, expert by expert in eager PyTorch
  (experts.py TEGroupedMLP._apply_bias: b * p, the sum, torch.cat, in bf16: the router's probabilities take the
  input's dtype, GPT-OSS's bridge sets no moe_router_dtype), 12 h elements per routed copy forward and backward
  (moe_timing.expert_bias_elements): +2.5 / +3.0 / +2.1.
  (6) YaRN's attention factor (0.1 ln 32 + 1), which Transformer Engine's fused RoPE cannot take: Megatron-Core
  applies rotary in eager PyTorch (rope_utils.apply_rotary_pos_emb) and Bridge turns apply_rope_fusion off for
  position_embedding_type "yarn" (fusions.validate_rope_fusion_compatibility), which its GPT-OSS bridge sets: 22
  elements moved per query and key element per layer (efficiency.unfused_rotary_elements): +1.9 / +2.1 / +1.6.
  (7) heads of 64: fused attention at FlashAttention-3's published head dim 64 rate, 0.71-0.77 of head dim 128's at
  the same lengths (arXiv:2407.08608 Fig. 5; toolkit/estimate/attention_rate.py): +1.6 / +1.7 / +1.3. It moves
  the dense rows with narrow heads too (GPT 1.7B and 3.6B, heads of 96: -17.4% -> -16.1%, -8.8% -> -7.8%; HF
  Llama 3.2 1B, heads of 64: +1.1% -> +4.3%).
  (8) the selective moe_act recompute the runs set: the activation runs again before fc2's backward, reading fc1's
  output once more (moe_timing.moe_act_recomputes): +0.7 / +0.7 / +0.6.
  (9) the sliding windows: a 128-token band has no causal half for the kernel to skip, and runs at the rate of
  blocks as short as the window (the shortest published length's, 512): +0.2 each.
  The parameter and FLOP counts were checked against the HF config the preset holds (hidden 2880, 64 query heads
  and 8 key/value heads of 64, 128 experts of 2880 top 4, vocabulary 201,088): 116.8 B parameters, 5.13 B active,
  as OpenAI's model card gives.
- What is left. GPT-OSS on GB200 is still predicted 33% fast (3.28 s against 4.92 s), on H100 18%, on B200 11%: at
  34.5 GFLOP a token Bridge measured 20%, 23% and 21% of the BF16 peak (H100, GB200, B200) where the model now
  reaches 25%, 34% and 23%. Not priced, for want of a published rate or a rule in the code: Transformer Engine's
  attention with learnable sinks, which only cuDNN's fused kernel runs (dot_product_attention/utils.py disables
  FlashAttention for softmax_type "learnable"), priced at FlashAttention-3's rate; no rate of cuDNN's sink kernels
  is published (Bridge's 26.06.01 summary footnotes a GPT-OSS pre-training regression as a known cuDNN frontend
  issue, NVIDIA/cudnn-frontend #256, not read here). The GB200 row needs 0.16 s more to be within 30% (3.44 s);
  attention is 0.31 s of its predicted step, so that kernel alone would have to run below about 2/3 of the published
  rate, which no measurement says, and nothing is set. Hidden size 2880 is 45 x 64 but 22.5 x 128: no waste with
  64-wide GEMM tiles, 2.2% with 128-wide, 6.7% with 256-wide, and which tile cuBLAS picks is its heuristic. The bias
  loop launches ~100 small kernels per layer at 16 experts a rank (H100, B200) but ~14 at 2 (GB200). On GB200 (EP 64
  over NCCL with the overlap on), NCCL's all-to-all takes SMs from the paired micro-batch's compute, which the
  overlap treats as free. Qwen3 235B on B200 (EP 8 in one node, NCCL all-to-all, no CUDA graphs, no overlap) is
  predicted 22% fast: like GPT-OSS's runs it ran without Bridge's CUDA graphs of the router and dispatch
  preprocessing, whose host cost the constant fitted on graphed runs does not carry (the row alone would fit 4.8 ms
  against the fitted 2.36). Qwen3 235B on GB200 is 18% slow: its HybridEP exchange over the NVL72 fabric and its
  CUDA graphs are, likely, faster than NCCL's all-to-all priced at the NVLink bus rate. Not modelled: MXFP8's
  quantisation of every GEMM input (row- and column-wise with scales), Bridge's CUDA graphs and fused router,
  DeepEP's and HybridEP's own SM budget (they take 20-64 SMs from the GEMMs), delay_wgrad_compute (Bridge sets it
  with the overlap).
- The GB200 rows run on the catalogue's NVL72 (4 GPUs a node, 72 on one NVLink domain: the plan's nvlink_domain,
  which the EP exchange reads through expert_parallel_domain()): Qwen3 235B's EP 32 and DeepSeek-V3's EP 64 stay on
  NVLink there.
"""


def moe_rows(refs: dict) -> tuple[list[dict], list[tuple[str, str]]]:
    """The MoE rows of one release, each at its published layout (the fastest pipeline split where it
    interleaves), balanced routing (--moe-imbalance 1, as the runs forced it), and the rows that cannot be evaluated
    yet with the reason."""
    rows, skipped = [], []
    for ref in refs["rows"]:
        try:
            model, gpu = load_model_spec(ref["model"]), get_gpu(ref["gpu"])
            options = topology_defaults(gpu, {**dict(backend="megatron", seq_len=4096, precision="fp8",
                                                     distributed_optimizer=True, recompute="none", moe_imbalance=1.0),
                                              **ref["plan"]})  # the GPU's node size and NVLink domain (NVL72)
            vpp = options.pop("vpp", 1)
            # a published layout (--pipeline-model-parallel-layout) places every layer itself
            splits = (pipeline_splits(model.num_layers, options["pp"], megatron=True)
                      if options.get("pp", 1) > 1 and "pipeline_model_parallel_layout" not in options
                      else [({}, [vpp])])
            plans = [resolve_plan(model, ref["gpus"], vpp=vpp, **split, **options) for split, vpps in splits
                     if vpp in vpps]
        except UserInputError as refused:
            skipped.append((ref["name"], str(refused).split("; known")[0].split("; presets")[0]))
            continue
        if not plans:
            skipped.append((ref["name"], f"no pipeline split of {model.num_layers} layers over pp {options['pp']} "
                                         f"interleaves {vpp} ways without a pipeline layout"))
            continue
        timed = [(step_time(model, plan, gpu, network_for(gpu)), plan) for plan in plans]
        predicted, plan = min(timed, key=lambda pair: pair[0].total_s)
        published = plan.global_batch * plan.seq_len / (ref["tokens_per_s_per_gpu"] * plan.gpus)
        parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.3g}" for k, v in predicted.as_dict().items()
                          if k in STEP_COMPONENTS and v > 0.005 * predicted.total_s)
        rows.append(dict(name=ref["name"], published_s=published, predicted_s=predicted.total_s, parts=parts,
                         fitted=ref["name"] in refs["fitted"]))
    return rows, skipped


def refit_moe_overhead(refs: dict) -> tuple[float, list[float]]:
    """MOE_LAYER_OVERHEAD_S refitted on the fitted rows alone (least squares of the relative error; the step is
    linear in it), and the value each fitted row would give alone: the check that the constant in the code is theirs."""
    fitted = {"rows": [r for r in refs["rows"] if r["name"] in refs["fitted"]], "fitted": refs["fitted"]}
    kept, runs = moe_timing.MOE_LAYER_OVERHEAD_S, []
    try:
        for value in (0.0, 1e-3):
            moe_timing.MOE_LAYER_OVERHEAD_S = value
            runs.append(moe_rows(fitted)[0])
    finally:
        moe_timing.MOE_LAYER_OVERHEAD_S = kept
    slopes = [((b["predicted_s"] - a["predicted_s"]) / 1e-3 / a["published_s"],
               (a["predicted_s"] - a["published_s"]) / a["published_s"]) for a, b in zip(*runs)]
    best = -sum(s * e for s, e in slopes) / sum(s * s for s, _ in slopes)
    return best, [-e / s for s, e in slopes]


def moe_report(refs: dict) -> None:
    rows, skipped = moe_rows(refs)
    print(f"\nMoE rows, one release ({refs['source']}; forced-balanced routing, predicted at --moe-imbalance 1; "
          f"step time from the published tokens/s/GPU, never the source's model TFLOP/s). Fitted: "
          f"{', '.join(refs['fitted']) or 'none (every row measures prediction)'}.")
    if refs["fitted"]:
        best, alone = refit_moe_overhead(refs)
        print(f"\nThe one constant fitted on them: MOE_LAYER_OVERHEAD_S (toolkit/estimate/moe_timing.py), least squares of "
              f"their relative error: {best * 1e3:.3g} ms per MoE layer forward (each alone: "
              f"{', '.join(f'{v * 1e3:.3g}' for v in alone)} ms; the code's: {moe_timing.MOE_LAYER_OVERHEAD_S * 1e3:.3g} "
              f"ms). No other row informed any constant.")
    print()
    print("| reference | published step s | predicted step s | error | predicted terms (s) |\n|---|---:|---:|---:|---|")
    errors = []
    for r in rows:
        error = (r["predicted_s"] - r["published_s"]) / r["published_s"]
        if not r["fitted"]:
            errors.append(abs(error))
        print(f"| {r['name']}{' (fitted)' if r['fitted'] else ''} | {r['published_s']:.3g} | {r['predicted_s']:.3g} | "
              f"{error:+.1%} | {r['parts']} |")
    if errors:
        errors.sort()
        median = (errors[(len(errors) - 1) // 2] + errors[len(errors) // 2]) / 2
        print(f"\n{len(errors)} MoE rows not fitted: median |error| {median:.1%}, largest {errors[-1]:.1%} (target: "
              f"median <= 15%, none beyond 30%): {'met' if median <= 0.15 and errors[-1] <= 0.30 else 'NOT met'}")
    if skipped:
        print("\nMoE rows not evaluated yet:\n\n| reference | why |\n|---|---|")
        for name, why in skipped:
            print(f"| {name} | {why} |")
    print(MOE_NOTES)


def report() -> None:
    refs = yaml.safe_load((HERE / "step_time_references.yaml").read_text())
    rows = [row for block in ("megatron_gpt", "megatron_ptd", "megatron_deep") for row in megatron_rows(refs[block])]
    rows += llama_rows(refs["llama3_405b"]) + path_rows(refs["h100_paths"])
    print(f"machine: {platform.node()} {platform.machine()} python {platform.python_version()}")
    print("| reference | published step s | predicted step s | error | fits | rank of published layout | "
          "slower than the winner | its recompute (Megatron-LM, Llama 3) or kernels | source |")
    print("|---|---:|---:|---:|---|---:|---:|---|---|")
    errors = []
    for r in rows:
        error = (r["predicted_s"] - r["published_s"]) / r["published_s"]
        errors.append(abs(error))
        if r["fitting"] is None:
            rank = gap = "-"
        else:
            rank = f"{r['rank']} of {r['fitting']}" if r["rank"] else f"not fitting ({r['fitting']} fit)"
            gap = f"{r['gap']:.1%}"
        print(f"| {r['name']} | {r['published_s']:.3g} | {r['predicted_s']:.3g} | {error:+.1%} | {r['fits']} | {rank} | "
              f"{gap} | {r['how']} | {r['source']} |")
    print("\nPublished rows the model cannot reach yet:\n\n| reference | why |\n|---|---|")
    for row in refs["h100_paths"]["unreachable"]:
        print(f"| {row['reference']} | {row['why']} |")
    print(NOTES)
    moe_report(refs["moe_26_04_01"])
    errors.sort()
    median = (errors[(len(errors) - 1) // 2] + errors[len(errors) // 2]) / 2
    print(f"\n{sum(e <= 0.10 for e in errors)} of {len(errors)} rows within 10%, {sum(e <= 0.15 for e in errors)} within "
          f"15%, {sum(e <= 0.20 for e in errors)} within 20% (target: median <= 10%, none beyond 20%); median |error| "
          f"{median:.1%}, largest {errors[-1]:.1%}")

    model, gpu = load_model_spec("llama-3.1-405b"), get_gpu("h100-80gb")
    start, cpu = time.perf_counter(), time.process_time()
    result = search(model, 16384, gpu, network_for(gpu), seq_len=8192, global_batch=2048)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"\nsearch: llama-3.1-405b on 16384 x h100-80gb, seq 8192, global batch 2048: {result.considered} plans "
          f"considered, {len(result.ranked)} fit, {elapsed:.2f} s ({cpu:.2f} s of CPU; the machine's load average "
          f"{os.getloadavg()[0]:.1f})")
    precision_pairs(refs["precision_pairs"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also write the markdown to this file")
    args = parser.parse_args()
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        report()
    print(buffer.getvalue(), end="")
    if args.write:
        args.write.write_text("# Step-time model vs published runs\n\nGenerated by `benchmarks/step_time_accuracy.py`.\n\n"
                              + buffer.getvalue())


if __name__ == "__main__":
    main()
