"""Why each number of `dmt estimate` is what it is: the rule, its source, and where it parts from the rule of thumb.

Every figure here is read off the breakdown the estimate prints (the `--json` record) or recomputed by the same
estimator on one data-parallel replica of the plan (its bytes per parameter before ZeRO / distributed-optimizer
sharding); nothing is a second copy of a byte rule. The rules of thumb are those of the course material:
12 bytes per parameter for mixed-precision Adam (16 in the ZeRO paper), "ZeRO-1 saves ~60% of optimizer memory",
activations ~2·b·s·h·L bytes, and training time 6·N·D FLOPs at the GPU's peak. What a backend's own sharding,
gradients and master copy read as are its explain part, toolkit/backends/<name>/explain.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.estimate.activations import head_bytes_per_token, mlp_bytes_per_token, moe_bytes_per_token
from toolkit.estimate.flops import layer_forward_flops, model_flops_per_token, six_n_flops_per_token
from toolkit.estimate.memory import activation_setup, alive_forwards, estimate_memory
from toolkit.estimate.moe_timing import MOE_LAYER_OVERHEAD_S, expert_overlap_share, expert_parallel_domain
from toolkit.estimate.packed_attention import attended_tokens
from toolkit.estimate.training_time import SECONDS_PER_DAY
from toolkit.numeric import GiB
from toolkit.spec.backend import ExplainPart
from toolkit.spec.backends import backend_of
from toolkit.spec.model import ModelSpec
from toolkit.spec.options import MOE_IMBALANCE_DEFAULT, MOE_IMBALANCE_NOTE
from toolkit.spec.plan import Plan

if TYPE_CHECKING:
    from toolkit.spec.prediction import Prediction

THUMB_STATE_BYTES = (12, 16)  # the course's mixed-precision Adam rule, and the ZeRO paper's 2 + 2 + 12
THUMB_ZERO1_SAVING = 0.60
THUMB_ACTIVATION_BYTES = 2  # per token, hidden unit and layer: one 16-bit copy of each layer's input
SOURCES = {
    "weights": "ZeRO (Rajbhandari et al., arXiv:1910.02054) Sec. 3-5; Transformer Engine's fp8 weight cache; "
               "toolkit/backends/<name>/memory.py; FSDP2 as Accelerate applies it: toolkit/backends/fsdp/memory.py",
    "gradients": "DeepSpeed deepspeed/runtime/bf16_optimizer.py (fp32 gradients at ZeRO-0) and "
                 "deepspeed/runtime/zero/stage_1_and_2.py (grads_in_partition); Megatron-Core "
                 "distributed/param_and_grad_buffer.py (fp32 main grads); measured on real 2-rank runs",
    "optimizer": "ZeRO arXiv:1910.02054 (K = 12 for mixed-precision Adam); Megatron-LM "
                 "docs/source/api-guide/dist_optimizer.md; toolkit/estimate/memory.py OPTIMIZER_BYTES",
    "model_states": "ZeRO arXiv:1910.02054 Sec. 3.1 (2 + 2 + 12 = 16 B/param); this estimator on one data-parallel "
                    "replica of the plan",
    "activations": "toolkit/estimate/activations.py, tensor by tensor, checked with torch saved_tensors_hooks "
                   "(tests/unit/test_activation_measurement.py, tests/megatron/test_megatron_recompute.py); "
                   "Korthikanti et al. arXiv:2205.05198 Sec. 4",
    "moe_activations": "Megatron-Core 0.16.1 transformer/moe/ (router.py, moe_utils.permute, experts.py); "
                       "toolkit/estimate/activations.py moe_bytes_per_token, measured at EP 2 on 2 gloo ranks "
                       "(tests/megatron/test_megatron_recompute.py)",
    "overhead": "toolkit/estimate/memory.py: CUDA context, allocator margin; toolkit/backends/deepspeed/memory.py: "
                "DeepSpeed bucket defaults (deepspeed/runtime/zero/config.py)",
    "step_time": "toolkit/estimate/timing.py (per-layer FLOPs, GEMM efficiency, exposed communication, bubble); "
                 "accuracy against published runs: benchmarks/step_time_accuracy.md; Megatron-LM arXiv:2104.04473 Eq. 3",
    "attention_flops": "PaLM (Chowdhery et al., arXiv:2204.02311) Appendix B: 12·L·q·s per token over the full score "
                       "matrix; per document: toolkit/estimate/packed_attention.py (checked against GPTDataset's "
                       "samples, tests/data/test_packed_attention.py); transformers' flash attention: "
                       "modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids",
    "goodput": "Daly, FGCS 22 (2006) 303-312 (optimum interval, expected wall time); Young, CACM 17(9) 1974; failure "
               "rate: Llama 3 arXiv:2407.21783 Sec. 3.3.4; toolkit/estimate/goodput.py, checkpoint_cost.py",
}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _bpp(n: float) -> str:
    return f"{n:.3g} B/param"


UNITS = {"step_time": "seconds", "attention_flops": "flops_per_token"}  # the rest are bytes


def _entry(component: str, value: float, rule: str, thumb: str, thumb_value: float | None, difference: str,
           **numbers) -> dict:
    return {"component": component, UNITS.get(component, "bytes"): value, "rule": rule,
            "source": SOURCES.get(component, SOURCES["step_time"]), "rule_of_thumb": thumb,
            "rule_of_thumb_value": thumb_value, "difference": difference, **numbers}


def _explain(plan: Plan) -> ExplainPart:
    """The plan's backend's own sentences (toolkit/backends/<name>/explain.py)."""
    return backend_of(plan).explain


def replica_plan(plan: Plan) -> Plan:
    """The same plan on one data-parallel replica, nothing offloaded: what every parameter costs before ZeRO /
    distributed-optimizer sharding and offload (experts unsplit, so expert data parallelism is 1 as well; the sequence
    unsplit, as ZeRO, FSDP2 and the distributed optimizer shard the states over the cp and sp ranks too)."""
    return plan.model_copy(update=dict(gpus=plan.model_parallel // plan.sequence_split, cp=1, sp=1, dp=1, ep=1,
                                       grad_accum=1,
                                       global_batch=plan.micro_batch, offload_optimizer="none", offload_params="none",
                                       **_explain(plan).one_replica(plan)))


def explain_estimate(model: ModelSpec, prediction: Prediction) -> list[dict]:
    """One entry per component of a `dmt estimate` prediction: rule, source, rule of thumb and the difference."""
    plan = prediction.plan
    mem, params = prediction.memory_bytes.model_dump(), prediction.params_per_gpu
    replica = estimate_memory(model, replica_plan(plan))
    per = {k: mem[k] / params for k in ("weights", "gradients", "optimizer")}
    unsharded = {k: getattr(replica, k) / replica.params_on_gpu for k in ("weights", "gradients", "optimizer")}
    entries = [_weights(plan, mem, params, per, unsharded), _gradients(plan, mem, params, per, unsharded),
               _optimizer(plan, mem, params, per, unsharded), _model_states(plan, mem, params, per, unsharded),
               _activations(model, plan, prediction), _overhead(prediction), _attention_flops(model, prediction),
               _step_time(model, prediction)]
    if model.is_moe and not backend_of(plan).hf_modules:
        entries.insert(5, _moe_activations(model, plan, prediction))
    if prediction.training_time is not None:
        entries += [_training_time(model, prediction), _goodput(prediction)]
    if model.is_moe:  # the routing the activations and the busiest expert rank's time assume
        for entry in entries:
            if entry["component"] in ("activations", "step_time"):
                entry["rule"] += "; " + moe_routing_clause(plan)
    return entries


def moe_routing_clause(plan: Plan) -> str:
    """How the plan routes tokens: the imbalance it assumes (--moe-imbalance) and where its default comes from."""
    source = ("given by --moe-imbalance" if plan.moe_imbalance != MOE_IMBALANCE_DEFAULT
              else f"default {MOE_IMBALANCE_NOTE}")
    capacity = (f", capacity factor {plan.moe_capacity_factor:g} (tokens beyond it dropped)"
                if plan.moe_capacity_factor is not None else ", dropless")
    return (f"MoE routing imbalance {plan.moe_imbalance:g} (busiest expert rank's tokens / the mean; {source})"
            f"{capacity}")


def experts_sharding(plan: Plan) -> str:
    """The clause a sharding adds for experts split over expert data parallelism ("" without experts)."""
    return f", experts over expert data parallelism = {plan.expert_dp}" if plan.ep > 1 else ""


def _weights(plan, mem, params, per, unsharded) -> dict:
    kept, why = _explain(plan).weights(plan)
    rule = f"{_bpp(unsharded['weights'])} ({kept or f'{plan.precision} parameters'})"
    if why is None:
        why = (f"{plan.precision} keeps {unsharded['weights']:.3g} bytes per parameter, not 2"
               if unsharded["weights"] != 2 else "same as the rule of thumb")
    return _entry("weights", mem["weights"], rule, f"2 B/param (one 16-bit copy): {_gib(2 * params)}", 2 * params,
                  why, bytes_per_param=per["weights"], params_on_gpu=params, bytes_per_param_unsharded=unsharded["weights"])


def _gradients(plan, mem, params, per, unsharded) -> dict:
    rule, why = _explain(plan).gradients(plan)
    return _entry("gradients", mem["gradients"], f"{_bpp(unsharded['gradients'])} unsharded; {rule}",
                  f"2 B/param (16-bit gradients): {_gib(2 * params)}", 2 * params, why,
                  bytes_per_param=per["gradients"], bytes_per_param_unsharded=unsharded["gradients"])


def _optimizer(plan, mem, params, per, unsharded) -> dict:
    full = unsharded["optimizer"] * params
    saving = 1 - mem["optimizer"] / full if full else 0.0
    explain = _explain(plan)
    kept = ("its states only: fp32 weights are their own master copy"
            if plan.precision == "fp32" or explain.master_copy(plan) is not None
            else f"an fp32 master copy and its states, training in {plan.precision}")
    rule = f"{plan.optimizer}: {_bpp(unsharded['optimizer'])} ({kept}); sharding: {explain.sharding(plan)}"
    if (offloaded := explain.optimizer_offloaded(plan)) is not None:
        why = offloaded
    elif saving > 0:
        why = (f"sharding keeps {1 - saving:.3g} of the states on this GPU: it saves {saving:.0%}, which is "
               f"1 - 1/(sharding degree), not a fixed ~{THUMB_ZERO1_SAVING:.0%}")
    else:
        why = "no sharding: every GPU keeps all optimizer states of its parameters"
    return _entry("optimizer", mem["optimizer"], rule,
                  f"'ZeRO-1 saves ~{THUMB_ZERO1_SAVING:.0%} of optimizer memory'", full * (1 - THUMB_ZERO1_SAVING),
                  why, bytes_per_param=per["optimizer"], bytes_per_param_unsharded=unsharded["optimizer"],
                  saving_vs_unsharded=saving)


def _model_states(plan, mem, params, per, unsharded) -> dict:
    states = mem["weights"] + mem["gradients"] + mem["optimizer"]
    replica_bpp = sum(unsharded.values())
    parts = " + ".join(f"{unsharded[k]:.3g}" for k in ("weights", "gradients", "optimizer"))
    explain = _explain(plan)
    why = f"one replica pays {parts} = {replica_bpp:.3g} B/param: " + (
        "fp32 training needs no master copy, but keeps 4-byte weights and gradients" if plan.precision == "fp32"
        else explain.master_copy(plan) or "the 12 B rule leaves out the fp32 master copy (4 B)")
    if replica_bpp > 16:
        why += "; the ZeRO paper's 16 assumes 16-bit gradients, while " + explain.fp32_gradients(plan)
    offloaded = [name for name, where in (("optimizer states", plan.offload_optimizer),
                                          ("parameters", plan.offload_params)) if where != "none"]
    why += f"; after sharding ({explain.sharding(plan)})" + (f" and offload of {' and '.join(offloaded)}" if offloaded else "")
    why += f" this GPU pays {states / params:.3g} B/param"
    return _entry("model_states", states, f"weights + gradients + optimizer = {_bpp(replica_bpp)} per replica",
                  f"{THUMB_STATE_BYTES[0]} B/param (course) or {THUMB_STATE_BYTES[1]} (ZeRO paper): "
                  f"{_gib(THUMB_STATE_BYTES[0] * params)} / {_gib(THUMB_STATE_BYTES[1] * params)}",
                  THUMB_STATE_BYTES[1] * params, why, bytes_per_param=states / params,
                  bytes_per_param_unsharded=replica_bpp)


def _activations(model: ModelSpec, plan: Plan, prediction: Prediction) -> dict:
    setup = activation_setup(model, plan)
    alive, _ = alive_forwards(model, plan, prediction.most_loaded_stage)
    tokens, h = setup.tokens, model.hidden_size
    last = prediction.most_loaded_stage == plan.pp - 1
    head = int(head_bytes_per_token(model, setup) * tokens) if last else 0
    layer_bytes = prediction.memory_bytes.activations - head
    per_unit = layer_bytes / (tokens * h * len(alive)) if alive else 0.0
    thumb = THUMB_ACTIVATION_BYTES * tokens * h * len(alive)
    rule = (f"what autograd saves, tensor by tensor, for {len(alive)} layer forward(s) in flight on this GPU "
            f"(b·s = {tokens} tokens per micro-batch); recompute={plan.recompute}")
    if plan.recompute == "full":
        why = ("full recomputation keeps only each layer's 16-bit input, which is the 2·b·s·h·L rule, plus one "
               "layer's working set during backward")
    else:
        why = (f"without full recomputation every layer keeps its norms' inputs and outputs, q, k, v, the attention "
               f"output and the MLP's ffn-wide tensors (ffn = {model.ffn_hidden_size / h:.2g}·h)")
        if plan.tp > 1:
            why += f", divided by tp = {plan.tp}" + (" (norms too, with sequence parallelism)"
                                                   if plan.sequence_parallel else "")
    if setup.gemm_input_bytes and plan.recompute != "full":
        why += (f"; in {plan.precision} Transformer Engine saves each GEMM's input quantized, "
                f"{setup.gemm_input_bytes:.3g} B an element (the norms' outputs, fc2's input, and the output "
                f"projection's own copy beside attention's bf16 output)")
    why += f": ~{per_unit:.3g} bytes per token per hidden unit per layer, not {THUMB_ACTIVATION_BYTES}"
    if head:
        why += f"; the last stage also holds the fp32 logits ({_gib(head)}), which the rule leaves out"
    return _entry("activations", prediction.memory_bytes.activations, rule,
                  f"2·b·s·h·L = 2 x {tokens} x {h} x {len(alive)} = {_gib(thumb)}", thumb, why,
                  bytes_per_token_hidden_layer=per_unit, layer_forwards_alive=len(alive), logits_bytes=head)


def _moe_activations(model: ModelSpec, plan: Plan, prediction: Prediction) -> dict:
    """The MoE layers' share of the activations, term by term (Megatron-Core's modules, activations.py
    moe_bytes_per_token), with the routing imbalance the routed experts' term is scaled by."""
    setup = activation_setup(model, plan)
    alive, _ = alive_forwards(model, plan, prediction.most_loaded_stage)
    moe_forwards = sum(model.is_moe_layer(i) for i in alive)
    scale = setup.tokens * moe_forwards / plan.tp  # what activations.py divides the per-token terms by
    terms = {name: value * scale for name, value in moe_bytes_per_token(model, setup).items()}
    total = sum(terms.values())
    stated = "the plan's" if plan.moe_imbalance != MOE_IMBALANCE_DEFAULT else f"default {MOE_IMBALANCE_NOTE}"
    rule = (", ".join(f"{name} {_gib(value)}" for name, value in terms.items()) +
            f" over {moe_forwards} MoE layer forward(s) in flight; routed copies per token: top-{model.experts_top_k}"
            f" x imbalance {setup.routed_factor:.3g} ({stated} --moe-imbalance {plan.moe_imbalance:g}, capped at "
            f"ep = {plan.ep}) x etp {plan.expert_tp} gathered")
    dense_mlp = 0.0
    if model.ffn_hidden_size:
        dense_mlp = mlp_bytes_per_token(model, setup.act_bytes, model.ffn_hidden_size, setup) * scale
    why = ("a dense MLP's activations (what Megatron-LM's theoretical memory prices an MoE layer as) would be "
           f"{_gib(dense_mlp)}; the routed experts keep each token k times, on the busiest rank times the imbalance")
    return _entry("moe_activations", total, rule, "an MoE layer as a dense MLP", dense_mlp, why,
                  routed_factor=setup.routed_factor, moe_imbalance=plan.moe_imbalance, **{f"{k}_bytes": v
                                                                                       for k, v in terms.items()})


def _overhead(prediction: Prediction) -> dict:
    detail = prediction.overhead_bytes
    total = prediction.memory_bytes.total
    items = ", ".join(f"{k} {_gib(v)}" for k, v in detail.items())
    return _entry("overhead", prediction.memory_bytes.overhead, items,
                  "usually left out", 0,
                  f"{prediction.memory_bytes.overhead / total:.0%} of this GPU's total: memory outside the "
                  f"tensors (CUDA context, communication buckets, the allocator's fragmentation) and transient "
                  f"tensors (head_backward: the loss's own peak above the layers' backward) still "
                  f"has to fit")


def _step_time(model: ModelSpec, prediction: Prediction) -> dict:
    plan = prediction.plan
    tokens_per_step = plan.global_batch * plan.seq_len
    peak = prediction.tflops_per_gpu * 1e12 / prediction.mfu if prediction.mfu else 0.0
    six_n = six_n_flops_per_token(model)
    ideal = six_n * tokens_per_step / (plan.gpus * peak) if peak else 0.0
    attended = attended_tokens(plan.seq_len, prediction.packed_attention)
    flops_ratio = model_flops_per_token(model, attended) / six_n
    breakdown = prediction.step_time_breakdown_s
    total = prediction.step_time_s
    shares = ", ".join(f"{k[:-2]} {v / total:.0%}" for k, v in breakdown.items() if v > 0)
    if breakdown.get("fixed_s"):  # only a calibration sets it
        shares += (f" (fixed: {breakdown['fixed_s']:.3g} s every step costs whatever its size, fitted by dmt "
                   f"calibrate)")
    if model.is_moe:
        shares += (f"; MoE: the busiest EP rank sets the pace at {plan.moe_imbalance:g} x the mean routed tokens "
                   f"(--moe-imbalance, capped at ep = {plan.ep}), expert GEMMs at the rate of their rows per expert, "
                   f"the EP all-to-alls {'inside' if plan.ep * plan.expert_tp <= expert_parallel_domain(plan) else 'across'} "
                   f"the NVLink domain"
                   + (" (flex: a token crosses the network once per remote domain)" if plan.moe_dispatcher == "flex"
                      else "")
                   + (f", hidden behind the paired micro-batch's compute in {expert_overlap_share(plan):.0%} of the "
                      f"passes (--overlap-moe-expert-parallel-comm)" if plan.overlap_moe_expert_parallel_comm else "")
                   + (f"; moe_overhead: {MOE_LAYER_OVERHEAD_S * 1e3:.3g} ms of host-side dispatch per MoE layer "
                      f"forward (the dispatcher's device-to-host sync and launches; fitted on two published runs)"
                      if plan.moe_dispatcher is not None else ""))
    return _entry("step_time", total, f"{total:.3g} s per step: {shares}",
                  f"6·N·D FLOPs at the GPUs' peak: {ideal:.3g} s per step", ideal,
                  f"model FLOPs are {flops_ratio:.3g} x 6·N (attention over {attended:,.0f} tokens per token adds to 6·N); "
                  f"GEMMs reach a size-dependent share of peak; communication, pipeline bubble, recomputation and "
                  f"the optimizer step add time: MFU {prediction.mfu:.1%}", seconds_at_peak=ideal,
                  flops_vs_6n=flops_ratio)


def _attention_flops(model: ModelSpec, prediction: Prediction) -> dict:
    """Which attention FLOPs the step time and MFU count: the whole sequence's, or a packed blend's documents'."""
    plan, packed = prediction.plan, prediction.packed_attention
    # the rule of thumb: every layer over the whole sequence (12·L·q·s when q, k and v heads are as wide)
    whole = 6 * model.num_layers * plan.seq_len * model.num_attention_heads * (model.head_dim + model.value_head_dim)
    attended = attended_tokens(plan.seq_len, packed)
    counted = 3 * sum(layer_forward_flops(model, i, attended).attention for i in range(model.num_layers))
    if packed is None:
        rule = f"the whole sequence: {plan.seq_len} tokens attended per token"
        why = ("no packed documents given (a recipe's data.blend with reset_position_ids and reset_attention_mask, "
               "`dmt estimate --data-recipe`): every sample's attention is counted over its whole sequence")
    else:
        rule = f"{'per document' if packed.squared_pieces is not None else 'the whole sequence'}: " \
               f"{attended:,.0f} tokens attended per token"
        why = packed.note
    windowed = sum(1 for i in range(model.num_layers) if model.attention_window(i))
    if windowed:
        rule += f"; {windowed} of {model.num_layers} layers attend at most {model.sliding_window} tokens"
        why += (f"; sliding-window layers ({model.family}'s layer_types) attend their window only, however long the "
                f"sequence")
    return _entry("attention_flops", counted, f"{rule}, forward and backward: {counted:.3g} FLOPs per token",
                  f"12·L·q·s over the whole sequence (s = {plan.seq_len}): {whole:.3g} FLOPs per token", whole, why,
                  attended_tokens=attended, counts_documents=packed is not None and packed.squared_pieces is not None)


def _training_time(model: ModelSpec, prediction: Prediction) -> dict:
    t, plan = prediction.training_time, prediction.plan
    peak = prediction.tflops_per_gpu * 1e12 / prediction.mfu if prediction.mfu else 0.0
    ideal_days = six_n_flops_per_token(model) * t.tokens / (plan.gpus * peak) / SECONDS_PER_DAY if peak else 0.0
    return _entry("training_time", t.days_compute * SECONDS_PER_DAY,
                  f"{t.steps:,} steps x {prediction.step_time_s:.3g} s = {t.days_compute:,.1f} days, "
                  f"{t.gpu_hours_compute:,.0f} GPU-hours without failures",
                  f"6·N·D at 100% of peak: {ideal_days:,.1f} days on these {plan.gpus} GPUs "
                  f"({ideal_days * plan.gpus:,.0f} days on one)", ideal_days * SECONDS_PER_DAY,
                  f"no run reaches peak: at the predicted MFU of {prediction.mfu:.1%} it takes "
                  f"{t.days_compute / ideal_days if ideal_days else 0:.2g} x the ideal; check a quoted '<N> days' "
                  f"against the one-GPU figure above", days=t.days_compute, days_at_peak=ideal_days)


def _goodput(prediction: Prediction) -> dict:
    t = prediction.training_time
    c = t.checkpoint
    young = (2 * c.blocking_s * t.mtbf_h * 3600) ** 0.5 if t.mtbf_h is not None else None
    return _entry("goodput", t.days * SECONDS_PER_DAY,
                  f"a save of {c.bytes / 1e9:,.1f} GB blocks {c.blocking_s:.3g} s "
                  f"({'async: the copy to host memory' if c.async_save else 'sync: the whole write'}); Daly's optimum "
                  f"interval {c.interval_s:,.0f} s ({c.interval_steps:,} steps); {t.interruptions:,.1f} interruptions "
                  f"expected: {t.days:,.1f} days, goodput {t.goodput:.1%}",
                  "Young's sqrt(2 x checkpoint time x MTBF)" + (f": {young:,.0f} s" if young is not None else ""),
                  young,
                  "Daly's higher-order optimum adds terms in sqrt(checkpoint / MTBF) and counts failures during "
                  "checkpoints and restarts; an async save's interval is at least its write time (one in flight)",
                  days=t.days, goodput=t.goodput)
