"""A recipe's plan: its explicit options resolved (with command-line overrides), or the planner's choice for `auto`."""

from __future__ import annotations

from toolkit.data.blend import blend_document_lengths
from toolkit.errors import UserInputError
from toolkit.estimate.comm import Network
from toolkit.estimate.packed_attention import blend_squared_pieces
from toolkit.planner.predict import predicted_record
from toolkit.planner.search import best_plan
from toolkit.spec.backends import BACKENDS, backend_of
from toolkit.spec.calibration import Calibration
from toolkit.spec.cluster import get_gpu, topology_defaults, with_host_memory
from toolkit.spec.model import ModelSpec
from toolkit.spec.options import VARIABLE_LENGTH_ATTENTION, for_backend, option_backends
from toolkit.spec.plan import Plan, resolve_plan
from toolkit.spec.prediction import PackedAttention, RecipePrediction
from toolkit.spec.quantization import refuse_on_cpu
from toolkit.spec.recipe import Recipe, megatron_layers, recipe_calibration, recipe_names


def recipe_options(recipe: Recipe, **overrides) -> dict:
    """The plan options a recipe sets (its plan section and the sizes it keeps elsewhere), overrides applied. A
    backend given on the command line leaves out the recipe's options of another backend (`--backend fsdp` on a
    recipe that says `zero: 2`)."""
    options = topology_defaults(get_gpu(recipe.cluster.gpu), dict(
        seq_len=recipe.training.seq_len, global_batch=recipe.training.global_batch,
        gpus_per_node=recipe.cluster.gpus_per_node, nvlink_domain=recipe.cluster.nvlink_domain,
        network=recipe.cluster.network))
    options.update({k: v for k, v in recipe.plan.model_dump(exclude={"auto"}).items() if v is not None})
    switched = overrides.get("backend")
    if switched is not None and switched != recipe.plan.backend:
        options = {k: v for k, v in options.items() if for_backend(k, switched)}
    options["transformer_impl"] = megatron_layers(recipe)
    options.update({k: v for k, v in overrides.items() if v is not None and k != "finetune"})
    # what trains: the recipe's finetune section, with the fields given on the command line
    options["finetune"] = {**recipe.finetune.model_dump(), **(overrides.get("finetune") or {})}
    return options


def recipe_plan(recipe: Recipe, model: ModelSpec, calibration: Calibration | None = None, **overrides) -> Plan:
    """The resolved Plan: the recipe's explicit plan (with command-line overrides), or the planner's choice, ranked
    with `calibration` (default: the recipe's cluster.calibration)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    options = recipe_options(recipe, **given)
    if recipe.cluster.accelerator == "cpu":  # before the CPU recipe's local layers refuse it in other words
        with recipe_names(given):
            refuse_on_cpu(options.get("precision") or "bf16")
    with recipe_names(given):
        if recipe.plan.auto:
            calibration = calibration or recipe_calibration(recipe)
            plan = best_plan(model, recipe.cluster.gpus, with_host_memory(get_gpu(recipe.cluster.gpu), recipe.cluster.host_memory_gb), calibration=calibration,
                             **options)
        else:
            plan = resolve_plan(model, recipe.cluster.gpus, **options)
    check_data_format(recipe, plan)
    check_restart(recipe, plan)
    check_local_checkpoint(recipe, plan)
    return plan


def check_data_format(recipe: Recipe, plan: Plan) -> None:
    """Chat and prompt/completion data go through the HF Trainer's collators (loss masks, packed position ids)."""
    if recipe.data.format != "text" and not backend_of(plan).hf_modules:
        raise UserInputError("data.format", f"{recipe.data.format} data (loss on the answers only) trains through the "
                                            f"HF Trainer: use plan.backend deepspeed or fsdp, or format: text")


def check_restart(recipe: Recipe, plan: Plan) -> None:
    """training.restart: in_process needs a training function that can run again in the same process (the backend's
    `in_process_restart`, docs/faults.md says which and why) and, today, launch.sh's one-node `inprocess` launcher."""
    if recipe.training.restart != "in_process":
        return
    backend = backend_of(plan)
    if not backend.in_process_restart:
        able = [b.label for b in BACKENDS.values() if b.in_process_restart]
        why = f" ({backend.in_process_refused})" if backend.in_process_refused else ""
        raise UserInputError("training.restart", f"in_process runs with the {' or '.join(able)} backend, not "
                                                 f"{backend.label}{why}; use relaunch")
    if recipe.cluster.num_nodes > 1:
        raise UserInputError("training.restart", "in_process is launched on one node (launch.sh inprocess); use "
                                                 "relaunch for several nodes")


def check_local_checkpoint(recipe: Recipe, plan: Plan) -> None:
    """checkpoint.local: a backend whose state NVRx's LocalCheckpointManager takes (Megatron-Core's sharded state
    dict as Megatron-Core's own MCoreTensorAwareStateDict); replication only on GPUs (docs/faults.md)."""
    local = recipe.checkpoint.local
    if local is None:
        return
    backend = backend_of(plan)
    if not backend.local_checkpoints:
        able = [b.label for b in BACKENDS.values() if b.local_checkpoints]
        raise UserInputError("checkpoint.local", f"NVRx's local checkpoints take the {' or '.join(able)} backend's "
                                                 f"sharded state (MCoreTensorAwareStateDict), not {backend.label}'s; "
                                                 f"remove checkpoint.local")
    if local.replication > 1 and recipe.cluster.accelerator == "cpu":
        raise UserInputError("checkpoint.local.replication", f"{local.replication} needs GPUs: NVRx 0.4.1 receives "
                                                             f"each replica through a CUDA buffer (replication/"
                                                             f"group_utils.py); use 1 on CPU ranks")


def recipe_prediction(recipe: Recipe, model: ModelSpec, plan: Plan, calibration: Calibration | None = None, /,
                      record: type[RecipePrediction] = RecipePrediction, **extra) -> RecipePrediction:
    """What plan.json and a run's run_plan.json record of a recipe's plan: the prediction on the recipe's cluster
    (catalogue links, or a calibration's), and the model spec it was made for (so a run can be re-predicted);
    `record` one with more fields (`extra`: plan.json's PlanFile)."""
    gpu = with_host_memory(get_gpu(recipe.cluster.gpu), recipe.cluster.host_memory_gb)
    network = Network.from_catalogue(gpu, recipe.cluster.gpus_per_node)
    return predicted_record(model, plan, gpu, network, calibration, record, packed_attention(recipe, plan),
                            model_spec=model.model_dump(mode="json"), **extra)


def packed_attention(recipe: Recipe, plan: Plan) -> PackedAttention | None:
    """The attention FLOPs a recipe's samples cost under a plan: None where its data packs no documents apart (no
    data.blend with reset_position_ids and reset_attention_mask); per document where the kernel is variable-length
    and the blend's .idx files are readable (their document lengths, toolkit/estimate/packed_attention.py); else the
    whole sequence, with the reason. Reading the .idx files is the only I/O of a prediction."""
    data = recipe.data
    if not (data.blend and data.reset_position_ids and data.reset_attention_mask):
        return None
    square = plan.seq_len ** 2
    if plan.attention not in VARIABLE_LENGTH_ATTENTION:
        kernels = ", ".join(VARIABLE_LENGTH_ATTENTION)
        hf = " or ".join(option_backends("attention"))
        how = (f"plan.attention {plan.attention} masks the documents apart over the whole score matrix"
               if for_backend("attention", plan.backend) else
               f"{backend_of(plan).label}'s attention runs over the whole score matrix (the local layers' document "
               f"mask; Transformer Engine's kernel stays causal)")
        return PackedAttention(squared_pieces=None, note=f"the whole sequence ({square:,} tokens^2 per sample): {how}; "
                                                         f"plan.attention {kernels} on {hf} counts the documents")
    try:
        datasets = blend_document_lengths(recipe)
    except UserInputError as exc:
        return PackedAttention(squared_pieces=None, note=f"the whole sequence ({square:,} tokens^2 per sample): the "
                                                         f"blend's document lengths are not readable here ({exc}); "
                                                         f"prepare the data and estimate again to count the documents")
    squares = blend_squared_pieces(datasets, plan.seq_len)
    documents = sum(len(lengths) for _, lengths in datasets)
    return PackedAttention(squared_pieces=squares, note=(
        f"per document: E[sum of squared document pieces] = {squares:,.0f} tokens^2 per sample of {plan.seq_len} "
        f"tokens, {squares / square:.1%} of the whole sequence's {square:,}, from the {documents:,} document lengths "
        f"of the blend's {len(datasets)} .idx file(s), weighted by the blend"))
