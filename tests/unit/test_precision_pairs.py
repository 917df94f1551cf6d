"""The precision pairs of benchmarks/step_time_references.yaml are what benchmarks/step_time_accuracy.md says they
are: one layout run in two precisions, each run's recipe one its GPU has, each with one published figure."""

from pathlib import Path

import pytest
import yaml

from toolkit.planner.search import pipeline_splits
from toolkit.spec.cluster import get_gpu
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan
from toolkit.spec.quantization import check_on_gpu

REFERENCES = Path(__file__).resolve().parents[2] / "benchmarks" / "step_time_references.yaml"
PAIRS = yaml.safe_load(REFERENCES.read_text())["precision_pairs"]
PRECISION_KEYS = {"precision", "fp8_recipe", "fp4_recipe", "fp8_param_gather"}  # what a run may set beside the layout
FIGURES = {"published", "tokens_per_s_per_gpu"}  # step seconds, or tokens/s/GPU (never a model TFLOP/s)


def run_plans(ref: dict) -> list:
    """Each run's plan at the pair's layout (the first pipeline split Megatron-Core accepts at its VPP)."""
    model = load_model_spec(ref["model"])
    plans = []
    for run in ref["runs"]:
        options = {**ref["plan"], **{key: value for key, value in run.items() if key in PRECISION_KEYS}}
        vpp = options.pop("vpp", 1)
        pp = options.get("pp", 1)
        splits = pipeline_splits(model.num_layers, pp, megatron=True) if pp > 1 else [({}, [1])]
        split = next(split for split, vpps in splits if vpp in vpps)
        plans.append(resolve_plan(model, ref["gpus"], vpp=vpp, **split, **options))
    return plans


@pytest.mark.parametrize("ref", PAIRS, ids=[ref["name"] for ref in PAIRS])
def test_pair_is_one_layout_in_two_precisions(ref):
    assert len(ref["runs"]) == 2
    for run in ref["runs"]:
        assert len(FIGURES & run.keys()) == 1, run
        assert run.keys() - FIGURES <= PRECISION_KEYS, run.keys() - FIGURES - PRECISION_KEYS
    first, second = run_plans(ref)
    recipes = [(plan.precision, plan.fp8_recipe, plan.fp4_recipe) for plan in (first, second)]
    assert recipes[0] != recipes[1]
    layout = first.model_dump(exclude=PRECISION_KEYS)
    assert second.model_dump(exclude=PRECISION_KEYS) == layout
    assert layout["gpus"] == ref["gpus"]
    gpu = get_gpu(ref["gpu"])
    for plan in (first, second):
        check_on_gpu(plan, gpu)  # Transformer Engine's own refusal of a recipe the part has no kernels for
