"""The prediction of a model under a plan (toolkit/spec/prediction.py's Prediction), shared by `dmt estimate --json`,
`dmt plan --json`, plan.json and the prediction a run keeps (run_plan.json): the plan, its predicted memory, step
time, tokens/s and MFU; and the short names the tables give a plan."""

from __future__ import annotations

from toolkit.estimate.comm import Network
from toolkit.estimate.lora import trainable_params
from toolkit.estimate.memory import MemoryBreakdown, estimate_memory, exceeded
from toolkit.estimate.params import count_params
from toolkit.estimate.timing import STEP_COMPONENTS, StepTime, step_time
from toolkit.spec.backends import backend_of
from toolkit.spec.calibration import Calibration
from toolkit.spec.cluster import GPU
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan
from toolkit.spec.prediction import PackedAttention, Prediction
from toolkit.spec.quantization import check_on_gpu

MFU_NOTE = "model FLOPs without recomputation (PaLM convention) / (step time x GPUs x dense peak)"
# LoRA's useful work: the frozen base's forward and input gradients, attention's three passes, the adapters' three
FINETUNE_MFU_NOTE = ("fine-tuning FLOPs without recomputation (2 x base matmuls, 3 x attention and adapters) / (step "
                     "time x GPUs x dense peak)")


def predicted_record(model: ModelSpec, plan: Plan, gpu: GPU, network: Network,
                     calibration: Calibration | None = None, record: type[Prediction] = Prediction,
                     packed: PackedAttention | None = None, **extra) -> Prediction:
    """The prediction of one plan, as every output that states one records it (see plan_record); `packed`: the
    attention a recipe's packed documents cost (toolkit/planner/recipe.py packed_attention), kept in the record."""
    check_on_gpu(plan, gpu)  # Transformer Engine's recipe checks, before any figure of a plan the GPU cannot run
    time = step_time(model, plan, gpu, network, calibration=calibration, packed=packed)
    return plan_record(model, plan, estimate_memory(model, plan), time, gpu, calibration, record,
                       packed_attention=packed, **extra)


def plan_record(model: ModelSpec, plan: Plan, memory: MemoryBreakdown, time: StepTime, gpu: GPU,
                calibration: Calibration | None = None, record: type[Prediction] = Prediction,
                **extra) -> Prediction:
    """The prediction of a plan whose memory and step time are known (the search's); `record` a Prediction with
    more fields (`extra`), as plan.json keeps."""
    counts = count_params(model)
    return record(
        model=model.name,
        family=model.family,
        params=dict(total=counts.total, embedding=counts.embedding, active=counts.active,
                    trainable=trainable_params(model, plan.finetune), mtp=counts.mtp),
        plan=plan,
        gpu=gpu.name,
        gpu_memory_bytes=gpu.memory_bytes,
        memory_bytes=memory.as_dict(),
        overhead_bytes=memory.overhead_detail,
        host_memory_bytes_per_gpu=memory.host_bytes,
        most_loaded_stage=memory.stage,
        params_per_gpu=memory.params_on_gpu,
        fits=exceeded(memory, gpu, plan.gpus_per_node) is None,
        step_time_s=time.total_s,
        tokens_per_s=time.tokens_per_s,
        tflops_per_gpu=time.tflops_per_gpu,
        mfu=time.mfu,
        mfu_definition=FINETUNE_MFU_NOTE if plan.finetune.peft else MFU_NOTE,
        execution_path=time.execution_path,
        peak_tflops=time.peak_tflops,
        calibration=None if calibration is None else calibration.describe(),
        step_time_breakdown_s={k: getattr(time, k) for k in STEP_COMPONENTS},
        **extra,
    )


def plan_label(plan: Plan) -> str:
    """Short human name of a plan, e.g. `megatron dp8 tp8 pp1 +sp +do mb1 rc=sel`."""
    parts = [plan.backend, f"dp{plan.dp}", f"tp{plan.tp}", f"pp{plan.pp}"]
    parts += [f"vpp{plan.vpp}"] if plan.vpp > 1 else []
    if plan.first_stage_layers is not None or plan.last_stage_layers is not None:
        parts.append(f"first{plan.first_stage_layers or '='}/last{plan.last_stage_layers or '='}")
    if plan.account_for_embedding_in_pipeline_split or plan.account_for_loss_in_pipeline_split:
        parts.append("+emb/loss-split")
    parts += [f"cp{plan.cp}"] if plan.cp > 1 else []
    parts += [f"ep{plan.ep}"] if plan.ep > 1 else []
    parts += backend_of(plan).search.label(plan)  # z2 +off-opt; shard8 rep2; +sp +dopt
    parts += [f"mb{plan.micro_batch}", f"rc={recompute_label(plan)}"]
    parts += [name for name, on in (("+tiled-mlp", plan.tiled_mlp), ("+tiled-loss", plan.tiled_loss),
                                    ("+off-act", plan.offload_activations != "none")) if on]
    parts += [f"{plan.finetune.method}-r{plan.finetune.r}"] if plan.finetune.peft else []
    return " ".join(parts)


def recompute_label(plan: Plan) -> str:
    """none, selective (core attention), selective:mlp, full, or full:block2 (2 layers of every chunk recomputed)."""
    if plan.recompute == "selective" and plan.recompute_modules != ("core_attn",):
        return "selective:" + "+".join(plan.recompute_modules)
    if plan.recompute == "full" and plan.recompute_num_layers is not None:
        return f"full:block{plan.recompute_num_layers}"
    return plan.recompute
