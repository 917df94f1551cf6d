"""Measure the model-state bytes each rank of a real DeepSpeed ZeRO 1/2/3 run holds, from the live DeepSpeed objects.

Run as:
    deepspeed --num_gpus 2 --master_port PORT tests/distributed/zero_probe.py \
        --stage S [--stage S2 ...] --config-json MODEL_CONFIG.json --out OUT.json \
        [--zero-extra '{"overlap_comm": true}']
Several stages run one after the other in the one launch (its start costs more than the step), each on a model
built and seeded afresh, each engine destroyed before the next; OUT may then hold `{stage}`.

On a machine without GPUs DeepSpeed picks its CPU accelerator and a gloo process group; `--num_gpus 2` then means
2 CPU ranks. The model is a random-init HF `LlamaForCausalLM` built from the LlamaConfig in MODEL_CONFIG.json (an HF
config.json), trained for ONE real step in bf16 (forward, backward, step on random tokens) so that the Adam moments
exist. DeepSpeed config: bf16, zero_optimization.stage=S (+ --zero-extra), AdamW with "torch_adam": true (no CPU Adam
op to compile), micro batch 1, gradient accumulation 1.

Output: rank 0 writes OUT.json, a JSON list with one object per rank (gathered with all_gather_object), sorted by
rank. Byte counts are per rank; a storage shared by several tensors (views of one flat buffer) is counted once
within a field. Fields:
  stage, rank, world_size, num_params (total model parameters; ds_numel under ZeRO-3)
  optimizer_bytes        = fp32_partition_bytes + optimizer_state_bytes (distinct storages over both)
  fp32_partition_bytes   fp32 master partition(s) this rank updates (ZeRO-1/2: single_partition_of_fp32_groups;
                         ZeRO-3: fp32_partitioned_groups_flat; BF16_Optimizer: fp32_groups_flat_partition)
  optimizer_state_bytes  tensors in the torch optimizer's state (exp_avg, exp_avg_sq and the 0-dim `step`)
  optimizer_step_bytes   the part of optimizer_state_bytes that is 0-dim `step` tensors
  weights_bytes          16-bit parameter data this rank keeps between steps. ZeRO-1/2: the storages behind the
                         module parameters (DeepSpeed's flat bit16 buffer, alignment padding included; every rank
                         holds all of it). ZeRO-3: the partitions `param.ds_tensor` (storages of the flat
                         lp_param_buffer they are views of), NOT the gathered copies.
  weights_numel_bytes    the same without padding: sum of numel * element_size of the tensors above
  stage3_persistent_bytes / stage3_persistent_params
                         ZeRO-3 only: full (gathered) copies of "persistent" parameters (numel <=
                         stage3_param_persistence_threshold, default 1e5), which stay resident on every rank next
                         to their partition. Not in weights_bytes.
  stage3_gathered_nonpersistent_bytes
                         ZeRO-3 only: full data still held by non-persistent params after the step (expect 0).
  weights_resident_bytes weights_bytes + stage3_persistent_bytes + stage3_gathered_nonpersistent_bytes
  gradient_bytes         BEST EFFORT, measured after backward and before step() (step() frees them): distinct
                         storages of gradient holders other than the reduce buckets: param.grad of the module
                         params, ZeRO-2 grads_in_partition, averaged_gradients, ZeRO-3 grad_partitions_flat_buffer,
                         and fp32 partition .grad. gradient_detail names each holder with its bytes and dtype.
  grad_bucket_bytes      the ipg reduce bucket buffer(s) alive after backward (reduce_bucket_size elements, a
                         torch.empty: allocated, not necessarily touched).
  grad_bucket_bytes_during_backward / grad_bucket_numels_during_backward
                         ZeRO-1/2 only: bucket bytes right after setup_buckets() (start of backward; they are
                         freed again at its end, so grad_bucket_bytes reads 0 there). 0 for ZeRO-3, whose bucket
                         is allocated once at init and shows in grad_bucket_bytes.
  gradient_bytes_after_step / grad_bucket_bytes_after_step
                         the same holders after step() (what stays allocated across steps).
  padding                alignment / partition padding in elements, per group
  optimizer_class, inner_optimizer_class, state_keys, state_dtypes, zero_config_effective, timings_s, rss_bytes
                         (the process's, so after an earlier stage of the same launch it includes what that left)

The process exits with os._exit(0) after destroy_process_group(): gloo can abort at interpreter exit after all the
work is done, so callers should judge by OUT.json as well as the exit code.
"""

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


class Storages:
    """Sum of bytes of distinct storages (views of one buffer count once)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.total = 0

    def add(self, tensor) -> int:
        """Add a tensor's storage; the bytes it newly contributed."""
        if tensor is None or not torch.is_tensor(tensor):
            return 0
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or storage.data_ptr() in self.seen:
            return 0
        self.seen.add(storage.data_ptr())
        self.total += nbytes
        return nbytes


def _numel_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _rss() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fp32_partitions(zero, stage: int) -> list:
    if hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1/2 (DeepSpeedZeroOptimizer)
        return list(zero.single_partition_of_fp32_groups)
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
        return list(zero.fp32_partitioned_groups_flat)
    if hasattr(zero, "fp32_groups_flat_partition"):  # BF16_Optimizer (ZeRO-1 with fp32 grad accumulation)
        return list(zero.fp32_groups_flat_partition)
    raise RuntimeError(f"stage {stage}: unknown ZeRO optimizer {type(zero).__name__}")


def _grad_holders(engine, zero) -> dict[str, list]:
    """Named lists of gradient tensors, excluding reduce buckets."""
    holders: dict[str, list] = {}
    holders["param.grad"] = [p.grad for p in engine.module.parameters() if p.grad is not None]
    holders["param.grad_accum"] = [getattr(p, "grad_accum", None) for p in engine.module.parameters()
                                   if getattr(p, "grad_accum", None) is not None]
    if getattr(zero, "grads_in_partition", None) is not None:
        holders["grads_in_partition"] = [zero.grads_in_partition]
    averaged = []
    for value in (getattr(zero, "averaged_gradients", None) or {}).values():
        if value is None:
            continue
        flat = getattr(value, "flat_partition", None)
        if flat is not None:
            averaged.append(flat)
        else:
            averaged.extend(t for t in value if torch.is_tensor(t))
    if averaged:
        holders["averaged_gradients"] = averaged
    if getattr(zero, "grad_partitions_flat_buffer", None) is not None:  # ZeRO-3
        holders["grad_partitions_flat_buffer"] = [zero.grad_partitions_flat_buffer]
    for name in ("fp32_groups_gradients_flat", "fp32_groups_gradient_flat_partition"):  # BF16_Optimizer
        tensors = [t for t in getattr(zero, name, None) or [] if torch.is_tensor(t)]
        if tensors:
            holders[name] = tensors
    holders["fp32_partition.grad"] = [t.grad for t in _fp32_partitions(zero, 0) if t.grad is not None]
    return {name: tensors for name, tensors in holders.items() if tensors}


def _bucket_tensors(zero) -> list:
    tensors = []
    for bucket in (getattr(zero, "ipg_buckets", None) or {}).values():
        buffer = getattr(bucket, "buffer", None)
        if torch.is_tensor(buffer):
            tensors.append(buffer)
        elif buffer:
            tensors.extend(t for t in buffer if torch.is_tensor(t))
    return tensors


def watch_bucket_allocation(zero) -> dict:
    """ZeRO-1/2 allocate their reduce buckets in setup_buckets() at the start of backward and free them at its end;
    record the bytes they had right after allocation (the peak a snapshot after backward cannot see)."""
    seen = {"grad_bucket_bytes_during_backward": 0, "grad_bucket_numels_during_backward": []}
    original = getattr(zero, "setup_buckets", None)
    if original is None:
        return seen

    def setup_buckets(*args, **kwargs):
        result = original(*args, **kwargs)
        storages, tensors = Storages(), _bucket_tensors(zero)
        for tensor in tensors:
            storages.add(tensor)
        if storages.total > seen["grad_bucket_bytes_during_backward"]:
            seen["grad_bucket_bytes_during_backward"] = storages.total
            seen["grad_bucket_numels_during_backward"] = [t.numel() for t in tensors]
            seen["grad_bucket_dtypes_during_backward"] = sorted({str(t.dtype) for t in tensors})
        return result

    zero.setup_buckets = setup_buckets
    return seen


def gradient_snapshot(engine) -> dict:
    zero = engine.optimizer
    storages = Storages()
    detail = {}
    for name, tensors in _grad_holders(engine, zero).items():
        added = sum(storages.add(t) for t in tensors)
        detail[name] = dict(storage_bytes_new=added, numel_bytes=_numel_bytes(tensors),
                            dtypes=sorted({str(t.dtype) for t in tensors}), tensors=len(tensors))
    buckets = Storages()
    bucket_tensors = _bucket_tensors(zero)
    for tensor in bucket_tensors:
        buckets.add(tensor)
    return dict(gradient_bytes=storages.total, gradient_detail=detail, grad_bucket_bytes=buckets.total,
                grad_bucket_dtypes=sorted({str(t.dtype) for t in bucket_tensors}),
                grad_bucket_numels=[t.numel() for t in bucket_tensors])


def model_state_snapshot(engine, stage: int) -> dict:
    zero = engine.optimizer
    inner = zero.optimizer
    params = list(engine.module.parameters())

    fp32 = _fp32_partitions(zero, stage)
    opt = Storages()
    fp32_bytes = sum(opt.add(t) for t in fp32)
    state_tensors, step_tensors, keys, dtypes = [], [], set(), {}
    for state in inner.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                keys.add(key)
                dtypes[key] = str(value.dtype)
                (step_tensors if value.dim() == 0 else state_tensors).append(value)
    state_bytes = sum(opt.add(t) for t in state_tensors)
    step_bytes = sum(opt.add(t) for t in step_tensors)

    out = dict(
        optimizer_class=type(zero).__name__,
        inner_optimizer_class=type(inner).__name__,
        fp32_partition_bytes=fp32_bytes,
        fp32_partition_numel=[t.numel() for t in fp32],
        fp32_partition_dtypes=sorted({str(t.dtype) for t in fp32}),
        optimizer_state_bytes=state_bytes + step_bytes,
        optimizer_step_bytes=step_bytes,
        optimizer_bytes=opt.total,
        optimizer_numel_bytes=_numel_bytes(fp32) + _numel_bytes(state_tensors) + _numel_bytes(step_tensors),
        state_keys=sorted(keys),
        state_dtypes=dtypes,
    )

    weights = Storages()
    if stage == 3:
        partitions = [p.ds_tensor for p in params]
        for tensor in partitions:
            weights.add(tensor)
        persistent = [p for p in params if getattr(p, "ds_persist", False)]
        gathered = [p for p in params if not getattr(p, "ds_persist", False) and p.data.numel() > 0]
        persistent_storages, gathered_storages = Storages(), Storages()
        for p in persistent:
            if p.data.numel() > 0:
                persistent_storages.add(p.data)
        for p in gathered:
            gathered_storages.add(p.data)
        out.update(
            weights_bytes=weights.total,
            weights_numel_bytes=_numel_bytes(partitions),
            weights_dtypes=sorted({str(t.dtype) for t in partitions}),
            stage3_persistent_params=sum(p.ds_numel for p in persistent),
            stage3_persistent_tensors=len(persistent),
            stage3_persistent_bytes=persistent_storages.total,
            stage3_gathered_nonpersistent_bytes=gathered_storages.total,
            weights_resident_bytes=weights.total + persistent_storages.total + gathered_storages.total,
            padding=dict(
                partition_numel_total=sum(p.partition_numel() for p in params),
                padding_numel_this_rank=sum(p.ds_tensor.numel() for p in params) - sum(
                    max(0, min(p.partition_numel(), p.ds_numel - dist.get_rank() * p.partition_numel()))
                    for p in params),
                lp_param_buffer_numel=getattr(getattr(zero, "lp_param_buffer", None), "numel", lambda: None)(),
                fp16_partitioned_groups_flat_numel=[int(n) for n in zero.fp16_partitioned_groups_flat_numel],
                groups_padding=[sum(g) for g in zero.groups_padding],
            ),
        )
    else:
        for p in params:
            weights.add(p.data)
        out.update(
            weights_bytes=weights.total,
            weights_numel_bytes=_numel_bytes([p.data for p in params]),
            weights_dtypes=sorted({str(p.dtype) for p in params}),
            weights_resident_bytes=weights.total,
        )
        flats = getattr(zero, "bit16_groups_flat", None) or []
        out["padding"] = dict(
            bit16_groups_flat_numel=[t.numel() for t in flats],
            params_numel=sum(p.numel() for p in params),
            partition_size=[int(n) for n in getattr(zero, "partition_size", [])],
            groups_padding_this_rank=[int(n) for n in getattr(zero, "groups_padding", [])],
        )
    out["num_params"] = sum(p.ds_numel if stage == 3 else p.numel() for p in params)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, required=True, choices=(1, 2, 3), action="append")
    parser.add_argument("--config-json", required=True, help="HF config.json of a Llama model")
    parser.add_argument("--out", required=True, help="OUT.json; with several --stage, `{stage}` in it is the stage")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--zero-extra", default="{}", help="JSON merged into zero_optimization")
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()
    for stage in args.stage:
        probe(stage, args.out.replace("{stage}", str(stage)), args)
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit after all the work is done


def probe(stage: int, out: str, args: argparse.Namespace) -> None:
    """One ZeRO stage: a model built and seeded afresh, one step, the records of every rank into `out`."""
    timings = {}
    t0 = time.perf_counter()
    with open(args.config_json) as handle:
        config = LlamaConfig(**{k: v for k, v in json.load(handle).items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    timings["build_model"] = time.perf_counter() - t0

    zero_config = {"stage": stage, **json.loads(args.zero_extra)}
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero_config,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "steps_per_print": 1_000_000,
    }
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    timings["initialize"] = time.perf_counter() - t0
    rank, world = dist.get_rank(), dist.get_world_size()
    rss = {"after_initialize": _rss()}

    buckets_during_backward = watch_bucket_allocation(engine.optimizer)
    t0 = time.perf_counter()
    generator = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=generator)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    grads = gradient_snapshot(engine)  # step() frees the gradients, so read them now
    engine.step()
    timings["train_step"] = time.perf_counter() - t0
    rss["after_step"] = _rss()
    after = gradient_snapshot(engine)

    zero_effective = engine.zero_optimization() and engine._config.zero_config
    record = dict(
        stage=stage,
        rank=rank,
        world_size=world,
        loss=float(loss.detach().float()),
        **model_state_snapshot(engine, stage),
        gradient_bytes=grads["gradient_bytes"],
        gradient_detail=grads["gradient_detail"],
        grad_bucket_bytes=grads["grad_bucket_bytes"],
        grad_bucket_dtypes=grads["grad_bucket_dtypes"],
        grad_bucket_numels=grads["grad_bucket_numels"],
        gradient_bytes_after_step=after["gradient_bytes"],
        gradient_detail_after_step=after["gradient_detail"],
        grad_bucket_bytes_after_step=after["grad_bucket_bytes"],
        **buckets_during_backward,
        zero_config_effective=(
            {k: getattr(zero_effective, k) for k in ("stage", "contiguous_gradients", "overlap_comm",
                                                     "reduce_bucket_size", "allgather_bucket_size",
                                                     "param_persistence_threshold", "sub_group_size")}
            if zero_effective else None),
        model_dtype=str(next(engine.module.parameters()).dtype),
        accelerator=deepspeed.get_accelerator().device_name(),
        backend=dist.get_backend(),
        timings_s=timings,
        rss_bytes=rss,
    )

    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        tmp = out + ".tmp"
        with open(tmp, "w") as handle:
            json.dump(sorted(records, key=lambda r: r["rank"]), handle, indent=1, default=str)
        os.replace(tmp, out)
    dist.barrier()
    engine.destroy()  # its hooks and buffers go before the next stage's engine


if __name__ == "__main__":
    main()
