"""Megatron-Core's pipeline_model_parallel_layout as a plan option: its syntax read as Megatron-Core 0.16.1's own
parser reads it, its checks, the balanced layouts the planner proposes for layers that do not divide (DeepSeek-V3's
61 + 1 MTP, Qwen3-235B's 94), and the layout reaching megatron.yaml / megatron_args.txt."""

import pytest

from toolkit.errors import UserInputError
from toolkit.generate.megatron import _parallel
from toolkit.generate.megatron_args import value_flags
from toolkit.spec.model import load_model_spec
from toolkit.spec.pipeline import PipelineSplit, balanced_layout, expand_layout
from toolkit.spec.plan import resolve_plan

DEEPSEEK_V3 = load_model_spec("deepseek-v3")  # 61 decoder layers + 1 MTP layer
QWEN3_235B = load_model_spec("qwen3-235b-a22b")  # 94 layers
# Megatron-LM's documented DeepSeek-V3 layout at PP 16 x VPP 2 (docs/user-guide/features/pipeline_parallel_layout.md,
# tag core_v0.16.1)
DOCUMENTED = "Et*3|(tt|)*29,m|L"


def _megatron_layout(text: str, pp: int, layers: int, mtp: int):
    """Megatron-Core's own PipelineParallelLayerLayout, parsed and validated (validate_layer_layout)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout  # lazy: megatron

    layout = PipelineParallelLayerLayout(text, pp)
    layout.validate_layer_layout(num_layers=layers, mtp_num_layers=mtp or None)
    return layout


@pytest.mark.parametrize("text", [DOCUMENTED, "Et*2|(tt|)*5t|tmL", "Et*3|(tt|)*6mL", "E,t|t,L"])
def test_the_syntax_expands_as_megatron_cores_parser_does(text):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout  # lazy: megatron

    letters = {"embedding": "E", "loss": "L", "decoder": "t", "mtp": "m"}
    theirs = ["".join(letters[t.name] for t in stage) for stage in PipelineParallelLayerLayout.parse_str_to_list(text)]
    assert expand_layout(text).split("|") == theirs


@pytest.mark.parametrize("layers, pp, vpp, mtp", [(61, 16, 2, 1), (61, 16, 1, 1), (61, 8, 4, 1), (94, 8, 4, 0),
                                                  (94, 16, 1, 0), (94, 4, 3, 0), (61, 4, 1, 1)])
def test_balanced_layouts_pass_megatron_cores_own_checks(layers, pp, vpp, mtp):
    from megatron.core.transformer.enums import LayerType  # lazy: megatron

    text = balanced_layout(layers, pp, vpp, mtp)
    layout = _megatron_layout(text, pp, layers, mtp)
    assert layout.virtual_pipeline_model_parallel_size == vpp
    split = PipelineSplit(layers, pp, vpp, layout=text)
    assert split.problem(mtp) is None and sum(split.rank_layer_counts()) == layers
    built = [[stage.count(LayerType.decoder) for stage in rank] for rank in layout.layout]
    assert split.chunk_sizes() == built  # the memory and step-time models see Megatron-Core's stages
    counts = [sum(len(stage) for stage in rank) for rank in layout.layout]  # layers + embedding + loss + MTP
    assert max(counts) - min(counts) <= 1  # balanced: the embedding, loss and MTP take a layer's place


def test_the_planners_deepseek_v3_layout_is_megatrons_shape():
    assert balanced_layout(61, 16, 2, 1) == expand_layout("Et|(tt|)*30mL")
    assert balanced_layout(3, 4, 1, 0) is None  # a stage would hold nothing


def test_a_layout_resolves_with_its_interleaving_and_reaches_the_generated_files():
    plan = resolve_plan(DEEPSEEK_V3, 1024, backend="megatron", pp=16, ep=64, global_batch=1024,
                        pipeline_model_parallel_layout=DOCUMENTED)
    assert plan.vpp == 2 and plan.pipeline_model_parallel_layout == expand_layout(DOCUMENTED)
    fields = _parallel(plan, DEEPSEEK_V3)
    assert fields["pipeline_model_parallel_layout"] == expand_layout(DOCUMENTED)
    config = {"transformer_config": {**fields, "num_layers": 61}}
    flags = value_flags(config)
    assert f"--pipeline-model-parallel-layout {expand_layout(DOCUMENTED)}" in flags
    assert not any(f.startswith("--num-virtual-stages-per-pipeline-rank") for f in flags)  # validate_args: one of


@pytest.mark.parametrize("options, key, says", [
    (dict(pp=16, pipeline_model_parallel_layout="Et*3|(tt|)*29,m|X"), "--pipeline-model-parallel-layout",
     "'X' is not a layer"),
    (dict(pp=16, pipeline_model_parallel_layout="Et*3|(tt|)*28,m|L"), "--pipeline-model-parallel-layout",
     "has 31 stages"),
    (dict(pp=16, vpp=4, pipeline_model_parallel_layout=DOCUMENTED), "--pipeline-model-parallel-layout",
     "needs pp x vpp = 16 x 4"),
    (dict(pp=16, pipeline_model_parallel_layout="Et*2|(tt|)*29,m|tL"), "--pipeline-model-parallel-layout",
     "come after every decoder layer"),
    (dict(pp=16, pipeline_model_parallel_layout="Et*2|(tt|)*29,m|L"), "--pipeline-model-parallel-layout",
     "places 60 decoder layers"),
    (dict(pp=16, pipeline_model_parallel_layout="t*3|(tt|)*29,m|EL"), "--pipeline-model-parallel-layout",
     "must start with the embedding"),
    (dict(pp=16, first_stage_layers=4, pipeline_model_parallel_layout=DOCUMENTED), "--pipeline-model-parallel-layout",
     "cannot be combined"),
])
def test_each_layout_refusal_names_the_option(options, key, says):
    with pytest.raises(UserInputError) as info:
        resolve_plan(DEEPSEEK_V3, 1024, backend="megatron", ep=64, global_batch=1024, **options)
    assert info.value.key == key and says in info.value.message and "\n" not in info.value.message, info.value


def test_the_search_proposes_layouts_where_layers_do_not_divide():
    from toolkit.planner.search import pipeline_splits

    qwen = pipeline_splits(QWEN3_235B.num_layers, 8, True)  # 94 + embedding + loss = 8 x 12: Megatron's own split
    assert (dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
            [2, 3, 4, 6]) in qwen  # PP 8 x VPP 4, as published Qwen3-235B runs use
    odd = pipeline_splits(QWEN3_235B.num_layers, 5, True)  # 96 slots over 5 stages: only a layout balances them
    assert odd and all("pipeline_model_parallel_layout" in s for s, _ in odd)
    deepseek = pipeline_splits(DEEPSEEK_V3.num_layers, 16, True, DEEPSEEK_V3.mtp_layers)
    layouts = {vpps[0]: s["pipeline_model_parallel_layout"] for s, vpps in deepseek}
    assert layouts[2] == balanced_layout(61, 16, 2, 1)
    assert pipeline_splits(80, 4, True) == [({}, [1, 2, 4, 5])]  # layers that divide: the even split only
