"""`dmt estimate`: parameter counts and the per-GPU memory breakdown of one model under one explicit plan."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from toolkit.cli.common import (
    add_network_arguments,
    add_plan_arguments,
    build_network,
    calibration_for,
    calibration_line,
    check_max_seq_len,
    plan_gpu,
    sharding_text,
)
from toolkit.cli.console import console as make_console
from toolkit.cli.estimate_explain import add_explain_arguments, add_extras, print_extras
from toolkit.cli.options import plan_overrides
from toolkit.cli.paths import path_arg
from toolkit.errors import named_as
from toolkit.estimate.efficiency import EXECUTION_PATHS
from toolkit.numeric import GiB, json_text
from toolkit.planner.max_seq_len import longest_sequence
from toolkit.planner.predict import predicted_record, recompute_label
from toolkit.planner.recipe import packed_attention
from toolkit.spec.backends import backend_of
from toolkit.spec.cluster import topology_defaults
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan
from toolkit.spec.recipe import load_recipe

if TYPE_CHECKING:
    from toolkit.planner.max_seq_len import Longest
    from toolkit.spec.prediction import Prediction


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)
    add_network_arguments(parser)
    parser.add_argument("--data-recipe", type=path_arg, default=None, metavar="RECIPE",
                        help="a recipe whose data section packs documents (data.blend with reset_position_ids and "
                             "reset_attention_mask): with --attention flash_attention_2 the attention FLOPs counted "
                             "are its documents', from the blend's .idx files (the whole sequence's where they are "
                             "not there yet; --explain says which)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_explain_arguments(parser)


def result(args: argparse.Namespace) -> Prediction | Longest:
    """What `dmt estimate` says of the model and plan its arguments name (what `--json` prints, and what `dmt explore`
    answers): the prediction, with training_time and explain when asked for; with --max-seq-len, the longest
    sequence the plan fits."""
    if args.max_seq_len:
        return longest(args)

    gpu = plan_gpu(args)
    network = build_network(args, gpu)
    calibration = calibration_for(args.calibration, gpu.name)
    model = load_model_spec(args.model)
    plan = resolve_plan(model, args.gpus, **topology_defaults(gpu, plan_overrides(args)))
    prediction = predicted_record(model, plan, gpu, network, calibration, packed=packing(args, plan))
    add_extras(prediction, model, args)
    return prediction


def packing(args: argparse.Namespace, plan):
    """What --data-recipe's packed documents cost in attention under `plan` (None: no recipe given)."""
    if args.data_recipe is None:
        return None

    with named_as(lambda key: "--data-recipe" if key in ("--recipe", "recipe") else None):
        recipe = load_recipe(args.data_recipe)
    return packed_attention(recipe, plan)


def longest(args: argparse.Namespace) -> Longest:
    """`dmt estimate --max-seq-len`: the longest sequence the options given fit (planner/max_seq_len.py)."""
    check_max_seq_len(args)
    gpu = plan_gpu(args)
    return longest_sequence(load_model_spec(args.model), args.gpus, gpu, **plan_overrides(args))


def run(args: argparse.Namespace) -> int:
    estimated = result(args)
    if args.max_seq_len:
        if args.json:
            print(json_text(estimated.as_json(), indent=2))
        else:
            print(longest_text(estimated))
        return 0 if estimated.plan is not None else 1
    if args.json:
        print(json_text(estimated.as_json(), indent=2))
    else:
        print_prediction(estimated)
        print_extras(estimated)
    return 0


def print_prediction(prediction: Prediction) -> None:
    from rich.table import Table

    plan, mem, params = prediction.plan, prediction.memory_bytes, prediction.params
    console = make_console()
    layout = " ".join(f"{k}={getattr(plan, k)}" for k in ("dp", "tp", "pp", "vpp", "cp", "ep"))
    console.print(
        f"[bold]{prediction.model}[/] ({prediction.family}): {params.total / 1e9:.3f}B params, "
        f"{params.active / 1e9:.3f}B active, {params.embedding / 1e9:.3f}B in embeddings"
        + (f"; {plan.finetune.method}: {params.trainable:,} trainable adapter parameters"
           if plan.finetune.method != "full" else "")
        + (f"; {params.mtp / 1e9:.3f}B in multi-token prediction modules besides, which "
           + ("Megatron-Core trains on the last stage (counted in memory and step time)"
              if not backend_of(plan).hf_modules else
              f"{plan.backend} drops: transformers' model does not build them (not counted)") if params.mtp else "")
    )
    console.print(
        f"{plan.backend} on {plan.gpus} x {prediction.gpu}: {layout} {sharding_text(plan)} "
        f"micro_batch={plan.micro_batch} grad_accum={plan.grad_accum} global_batch={plan.global_batch} "
        f"seq_len={plan.seq_len} recompute={recompute_label(plan)} {plan.precision}"
        + (f" layers={plan.transformer_impl}" if plan.transformer_impl else "")
    )
    table = Table(title=f"Per GPU, stage {prediction.most_loaded_stage}", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    for key in ("weights", "gradients", "optimizer", "activations", "overhead"):
        table.add_row(key, f"{getattr(mem, key) / GiB:.2f}")
    table.add_row("[bold]total[/]", f"[bold]{mem.total / GiB:.2f}[/]")
    console.print(table)
    detail = ", ".join(f"{k} {v / GiB:.2f}" for k, v in prediction.overhead_bytes.items())
    console.print(f"overhead: {detail} GiB")
    if prediction.host_memory_bytes_per_gpu:
        console.print(f"host RAM for offload: {prediction.host_memory_bytes_per_gpu / GiB:.2f} GiB per GPU")
    capacity = prediction.gpu_memory_bytes / GiB
    verdict = "[green]fits[/]" if prediction.fits else "[red]does not fit[/]"
    console.print(f"{verdict} in {capacity:.1f} GiB ({prediction.gpu})")
    console.print(
        f"predicted step {prediction.step_time_s:.3g} s, {prediction.tokens_per_s:,.0f} tokens/s, "
        f"{prediction.tflops_per_gpu:.3g} TFLOP/s per GPU, MFU {prediction.mfu:.1%} "
        f"({prediction.mfu_definition})"
    )
    execution = EXECUTION_PATHS[prediction.execution_path]
    fitted = ((prediction.calibration or {}).get("compute_scale") or {}).get(execution.name)
    scale = f"{execution.compute_scale:.2f}" if fitted is None else \
        f"{fitted:.3g} (calibrated; published {execution.compute_scale:.2f})"
    fixed = prediction.step_time_breakdown_s["fixed_s"]
    fixed_text = f", plus a fixed {fixed:.3g} s per step (calibrated)" if fixed else ""
    console.print(f"execution path {execution.name}: {execution.description}, {scale} of the fused kernels' "
                  f"rate{fixed_text} (toolkit/estimate/efficiency.py)")
    console.print(calibration_line(prediction.calibration))


def longest_text(found) -> str:
    """The --max-seq-len answer in one or two lines."""
    limit = found.limit
    if limit["seq_len"] is None:
        return f"max seq_len: at least {found.max_seq_len:,} (the search stops there)"
    where = "per node in host RAM" if limit["where"] == "host" else "per GPU"
    stop = (f"at {limit['seq_len']:,}: {limit['total_bytes'] / GiB:.1f} GiB {where} > {limit['capacity_bytes'] / GiB:.1f} "
            f"GiB, the largest term {limit['component']} ({limit['bytes'] / GiB:.1f} GiB)")
    if found.plan is None:
        return f"max seq_len: none fits; {stop}"
    return f"max seq_len: {found.max_seq_len:,} tokens\nstops {stop}"
