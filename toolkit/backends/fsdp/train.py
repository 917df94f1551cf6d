"""FSDP2 under the HF Trainer: the plan's mixed precision policy, and the check, after preparation and on every device,
that the model really is sharded as the plan says, with what each rank holds written to sharding.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.backends.fsdp.checkpoint import MANIFEST_FORMAT
from toolkit.backends.hf_hooks import TrainerHooks, refuse_fp16_without_gpu
from toolkit.backends.peft_model import save_sharded_adapter
from toolkit.compat.accelerate_seams import fsdp_on_cpu_ranks
from toolkit.compat.torch_seams import fsdp_param_groups
from toolkit.errors import UserInputError
from toolkit.spec.plan import Plan

if TYPE_CHECKING:
    from toolkit.backends.context import TrainContext

log = logging.getLogger(__name__)
SHARDING_FILE = "sharding.json"
# FSDP2 shards dim 0 in ceil(n / dp_shard) rows per rank: a rank may hold a little more than 1/dp_shard of a tensor
PADDING_SLACK = 0.05


def mixed_precision_policy(precision: str):
    """FSDP2's MixedPrecisionPolicy for a plan precision: gather parameters in the compute dtype, reduce-scatter
    gradients in fp32 (Accelerate's own default reduces in the compute dtype); None for fp32 training."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # fp8: Accelerate's recipe runs the linear layers' GEMMs in fp8, everything else (and the gathers) in bf16
    dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=dtype)


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def parameter_shards(model) -> dict:
    """This rank's trainable parameters: how many are DTensors sharded over a mesh, and their local and global bytes."""
    from torch.distributed.tensor import DTensor, Shard

    found = {"parameters": 0, "sharded": 0, "unsharded": [], "local_bytes": 0, "global_bytes": 0, "shard_mesh": []}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        found["parameters"] += 1
        size = param.element_size()
        found["global_bytes"] += param.numel() * size
        local = _local(param)
        found["local_bytes"] += local.numel() * local.element_size()
        shard_dims = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)] \
            if isinstance(param, DTensor) else []
        if shard_dims:
            found["sharded"] += 1
            found["shard_mesh"] = sorted(set(found["shard_mesh"]) | {param.device_mesh.size(i) for i in shard_dims})
        else:
            found["unsharded"].append(name)
    return found


def offload_policies(model) -> set[str]:
    """The class names of the offload policies of the model's FSDP2 parameter groups (CPUOffloadPolicy or
    OffloadPolicy): what fully_shard was really given, not what the plugin was asked for."""
    from torch.distributed.fsdp import FSDPModule

    names = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            names |= {type(group.offload_policy).__name__ for group in fsdp_param_groups(module)}
    return names


def check_sharded(model, plan: Plan) -> dict:
    """This rank's parameter shards, or one line saying how the prepared model differs from the plan (an unsharded
    model, DDP for instance, trains just as well, so nothing else would tell)."""
    shards = parameter_shards(model)
    expected = plan.dp_shard * plan.tp
    if shards["unsharded"]:
        raise UserInputError("fsdp", f"after preparation {len(shards['unsharded'])} of {shards['parameters']} "
                                     f"parameters are not FSDP2 shards (e.g. {shards['unsharded'][0]}; the model is "
                                     f"{type(model).__name__}): the run would train unsharded, not the plan's "
                                     f"dp_shard={plan.dp_shard}")
    share = shards["local_bytes"] / shards["global_bytes"] if shards["global_bytes"] else 0.0
    if expected > 1 and not share <= (1 + PADDING_SLACK) / expected:
        raise UserInputError("fsdp", f"this rank holds {share:.3f} of the parameters, the plan shards them over "
                                     f"dp_shard={plan.dp_shard}{f' x tp={plan.tp}' if plan.tp > 1 else ''} "
                                     f"({1 / expected:.3f} each)")
    policies = offload_policies(model)
    wanted = "CPUOffloadPolicy" if plan.offload_params == "cpu" else "OffloadPolicy"
    if policies != {wanted}:
        raise UserInputError("fsdp", f"after preparation the FSDP2 offload policies are {sorted(policies)}, the plan's "
                                     f"offload_params={plan.offload_params} asks for {wanted}")
    shards["offload_policy"] = wanted
    return shards


def state_bytes(model, optimizer) -> dict:
    """Bytes of this rank's gradient shards and optimizer states (read between the optimizer step and zero_grad)."""
    grads = sum(_local(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    inner = getattr(optimizer, "optimizer", optimizer)
    states = 0
    for state in inner.state.values():
        states += sum(_local(v).nbytes for v in state.values() if hasattr(v, "nbytes"))
    return {"gradient_bytes": int(grads), "optimizer_bytes": int(states)}


def sharding_callback(output_dir: Path, plan: Plan):
    """Checks the prepared model when training begins; after the first optimizer step writes, from rank 0, what every
    rank holds (sharding.json: parameter, gradient and optimizer bytes, local and global)."""
    from transformers import TrainerCallback

    class ShardingCallback(TrainerCallback):
        def __init__(self):
            self.shards: dict | None = None
            self.recorded = False

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.shards = check_sharded(model, plan)
            log.info("FSDP2: %d parameters sharded over a mesh of %s; this rank holds %.3f of their bytes",
                     self.shards["sharded"], self.shards["shard_mesh"],
                     self.shards["local_bytes"] / max(1, self.shards["global_bytes"]))

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            if self.shards is None or self.recorded:  # the first step of this launch only
                return
            self.recorded = True
            import torch.distributed as dist

            mine = {**{k: v for k, v in self.shards.items() if k != "unsharded"}, **state_bytes(model, optimizer)}
            ranks = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
            if dist.is_initialized():
                dist.all_gather_object(ranks, mine)
            if state.is_world_process_zero:
                record = {"dp_shard": plan.dp_shard, "dp_replicate": plan.dp_replicate, "tp": plan.tp,
                          "ranks": ranks}
                (output_dir / SHARDING_FILE).write_text(json.dumps(record, indent=2) + "\n")

    return ShardingCallback()



def refuse_context_parallel_without_gpu() -> None:
    """torch context parallel shards SDPA through the CUDA kernels' sharding strategies only: on CPU ranks the first
    attention fails deep in the step (torch 2.13: "NotImplementedError: Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered")."""
    import torch

    if not torch.cuda.is_available():
        raise UserInputError("plan.cp", "torch context parallel needs GPUs: torch has no context-parallel attention "
                                        "for CPU ranks (aten._scaled_dot_product_flash_attention_for_cpu has no "
                                        "sharding strategy); train cp > 1 on GPUs")


class FsdpHooks(TrainerHooks):
    accelerate_variable = "ACCELERATE_USE_FSDP"
    checkpoint_format = MANIFEST_FORMAT
    layout_keys = ("dp", "dp_shard", "dp_replicate", "tp", "reshard_after_forward")

    def arguments(self, args_dict, recipe, plan, world, deepspeed_json, generated_deepspeed, resharded):
        if deepspeed_json:
            raise UserInputError("--deepspeed", "is a DeepSpeed option; the fsdp backend shards with FSDP2")
        if plan.precision == "fp16":  # what Accelerate would refuse only after the model is built (its grad scaler)
            refuse_fp16_without_gpu()
        if plan.cp > 1:
            refuse_context_parallel_without_gpu()

    def accelerator_building(self, plan):
        """On CPU ranks an fsdp plan needs Accelerate's FSDP branch opened (toolkit/compat/accelerate_seams.py)."""
        import torch

        if torch.cuda.is_available():
            return super().accelerator_building(plan)

        return fsdp_on_cpu_ranks()

    def on_accelerator(self, accelerator, plan):
        accelerator.state.fsdp_plugin.mixed_precision_policy = mixed_precision_policy(plan.precision)

    def callbacks(self, output_dir, plan):
        return [sharding_callback(output_dir, plan)]

    def on_save(self, model, checkpoint, is_main):
        if is_main:  # sharded DCP weights carry no config: `dmt convert fsdp-to-hf` finds it beside them
            model.config.save_pretrained(checkpoint)

    def save_adapter(self, model, checkpoint, is_main):
        save_sharded_adapter(model, checkpoint, is_main)


TRAINER_HOOKS = FsdpHooks()


def train(context: TrainContext) -> dict:
    """train.py's entry: the HF Trainer with Accelerate's FSDP2 plugin from the generated trainer arguments."""
    from toolkit.backends.hf_trainer import train as train_hf  # lazy: transformers (the fsdp part loads at plan time)

    return train_hf(context)
