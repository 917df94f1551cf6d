"""The plan search's shortcuts change no answer: every ranked plan's memory and step time equal what the public
estimate gives for that plan afresh (its memos bypassed), and the plans the search skips without estimating
their activations (memory_floor) are exactly the ones an unpruned search finds out of memory. Speed is measured in
benchmarks/plan_search_speed.py, never here."""

import pytest

import toolkit.planner.search as plan_search
from toolkit.errors import UserInputError
from toolkit.estimate.comm import Network
from toolkit.estimate.memory import estimate_memory, exceeded, memory_floor
from toolkit.estimate.timing import step_time
from toolkit.planner.search import search
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import load_model_spec
from toolkit.spec.options import RECOMPUTE_KEYS
from toolkit.spec.plan import resolve_plan, with_block_recompute, with_recompute

DERIVED = ("dp", "grad_accum", "gpus")
# (model, GPUs, GPU, pinned options): an MoE model over folded and unfolded expert meshes, and a dense model on every
# backend with interleaving, each on a GPU small enough that many layouts' model states alone overflow it
CASES = [
    ("qwen3-30b-a3b", 16, "a100-40gb", dict(backends=("megatron",), seq_len=4096, global_batch=32)),
    ("llama-3.1-8b", 16, "rtx-4090", dict(seq_len=4096, global_batch=64)),
]


def _fresh(model):
    """The same model as a new object: every memo keyed by the spec's identity misses, so each figure is computed
    anew."""
    return model.model_copy()


@pytest.fixture(params=CASES, ids=[f"{c[0]}x{c[1]}" for c in CASES], scope="module")
def case(request):
    name, gpus, gpu_name, pinned = request.param
    gpu = get_gpu(gpu_name)
    network = Network.from_catalogue(gpu, 8)
    model = load_model_spec(name)
    return model, gpus, gpu, network, pinned, search(model, gpus, gpu, network, **pinned)


def test_ranked_figures_equal_the_public_estimate_of_each_plan(case):
    """Each plan on its own model object: no figure of another plan of its layout (the model states the search shares
    between them, toolkit/estimate/memory.py MODEL_STATE_BLIND) answers for it."""
    model, gpus, gpu, network, _, result = case
    assert len(result.ranked) > 10
    for candidate in result.ranked:
        fresh = _fresh(model)
        plan = resolve_plan(fresh, gpus, **{k: v for k, v in candidate.plan.as_dict().items() if k not in DERIVED})
        assert plan == candidate.plan and plan is not candidate.plan
        memory = estimate_memory(fresh, plan)
        assert memory == candidate.memory  # every field, to the byte
        assert exceeded(memory, gpu, plan.gpus_per_node) is None
        assert step_time(fresh, plan, gpu, network) == candidate.time  # every component, to the last digit
    totals = [c.time.total_s for c in result.ranked]
    assert totals == sorted(totals)


def test_skipping_plans_by_their_model_states_changes_no_answer(case, monkeypatch):
    """The same search without the memory_floor shortcut (every candidate estimated in full) gives the same ranked
    plans, figures, refusals and counts; and the floor did skip some, each of which the full estimate finds out of
    memory."""
    model, gpus, gpu, network, pinned, result = case
    skipped = []

    def unpruned(spec, plan, enough=None):
        if memory_floor(spec, plan, enough) > gpu.memory_bytes:
            skipped.append(plan)
        return 0  # no plan is refused before its full estimate

    monkeypatch.setattr(plan_search, "memory_floor", unpruned)
    full = search(_fresh(model), gpus, gpu, network, **pinned)
    assert [(c.plan, c.memory, c.time) for c in full.ranked] == [(c.plan, c.memory, c.time) for c in result.ranked]
    assert (full.considered, full.rejected) == (result.considered, result.rejected)
    assert skipped, "the case exercises no pruning"
    for plan in skipped:
        memory = estimate_memory(model, plan)
        assert exceeded(memory, gpu, plan.gpus_per_node) == ("gpu", memory.total)


def test_the_floor_never_exceeds_the_estimate(case):
    """memory_floor is a lower bound of estimate_memory's total for every layout the search walks, at each recompute
    option and micro-batch, fitting or not (the search's pruning is sound only if it is)."""
    model, gpus, gpu, _, pinned, _ = case
    fixed = {k: v for k, v in pinned.items() if k != "backends"}
    fixed.update(gpus_per_node=8, nvlink_domain=8)
    checked = 0
    for backend in pinned.get("backends", ("megatron", "deepspeed", "fsdp")):
        options = plan_search.backend_of(backend).search.recompute_options()
        for layout in list(plan_search.enumerate_layouts(model, gpus, 8, backend, fixed))[::7]:
            for micro, option in ((1, options[0]), (4, options[-1])):
                settings = {k: v for k, v in option.items() if k in RECOMPUTE_KEYS}
                try:
                    plan = resolve_plan(model, gpus, micro_batch=micro, **layout, **settings)
                except UserInputError:  # a layout the rules refuse at this micro-batch: nothing to bound
                    continue
                total = estimate_memory(model, plan).total
                assert memory_floor(model, plan) <= total and memory_floor(model, plan, 0) <= total
                checked += 1
    assert checked > 20


def test_block_recompute_copies_what_resolving_gives(case):
    """The search's bisection copies a resolved full-recompute plan with recompute_num_layers (with_block_recompute):
    the same plan resolve_plan gives with that option, and the same refusal where the rules refuse it."""
    model, gpus, _, _, _, result = case
    megatron = [c.plan for c in result.ranked if c.plan.backend == "megatron"]
    assert megatron
    for plan in megatron[::5]:
        options = {k: v for k, v in plan.as_dict().items() if k not in DERIVED and k != "recompute_num_layers"}
        full = resolve_plan(model, gpus, **{**options, "recompute": "full", "recompute_modules": None})
        for layers in (1, 2, 3):
            copied = with_block_recompute(full, model, layers)
            assert copied == resolve_plan(model, gpus, **{**options, "recompute": "full", "recompute_modules": None,
                                                          "recompute_num_layers": layers})
            assert copied.recompute_num_layers == layers and full.recompute_num_layers is None
    selective = resolve_plan(model, gpus, **{**options, "recompute": "selective", "recompute_modules": None})
    with pytest.raises(UserInputError) as copied_error:
        with_block_recompute(selective, model, 2)
    with pytest.raises(UserInputError) as resolved_error:
        resolve_plan(model, gpus, **{**options, "recompute": "selective", "recompute_modules": None,
                                     "recompute_num_layers": 2})
    assert (copied_error.value.key, str(copied_error.value)) == (resolved_error.value.key, str(resolved_error.value))
    with pytest.raises(UserInputError, match="positive integer"):
        with_block_recompute(full, model, 0)


def test_other_plans_of_a_layout_copy_what_resolving_gives(case):
    """The search resolves the first plan of a layout and copies it for the layout's other micro-batches and recompute
    options (with_recompute): for each ranked plan, each micro-batch and each option of its backend, with the global
    batch given and derived, the same plan resolve_plan gives, or the same refusal."""
    model, gpus, _, _, _, result = case
    compared = 0
    for candidate in result.ranked[::7]:
        options = {k: v for k, v in candidate.plan.as_dict().items()
                   if k not in DERIVED and k not in RECOMPUTE_KEYS and k != "micro_batch"}
        for given in (True, False):
            layout = options if given else {k: v for k, v in options.items() if k != "global_batch"}
            try:
                base = resolve_plan(model, gpus, **layout, micro_batch=candidate.plan.micro_batch)
            except UserInputError:  # one micro-batch per step (no global batch given) refuses interleaving
                continue
            for micro in (1, 2, 4):
                for option in plan_search.backend_of(base.backend).search.recompute_options():
                    settings = {k: v for k, v in option.items() if k in RECOMPUTE_KEYS}
                    try:
                        resolved = resolve_plan(model, gpus, **layout, micro_batch=micro, **settings)
                    except UserInputError as exc:
                        with pytest.raises(UserInputError) as copied_error:
                            with_recompute(base, model, settings, micro, given)
                        assert (copied_error.value.key, str(copied_error.value)) == (exc.key, str(exc))
                        continue
                    assert with_recompute(base, model, settings, micro, given) == resolved
                    compared += 1
    assert compared > 50
