"""Our pipeline split and schedule against Megatron-Core's own functions: same layers per rank and virtual stage,
same refusals, and the peak in-flight forwards of its schedules."""

from __future__ import annotations

import pytest

from toolkit.errors import UserInputError
from toolkit.estimate.memory import estimate_stage_memory, stage_layers
from toolkit.estimate.pipeline import peak_forwards
from toolkit.planner.search import pipeline_splits
from toolkit.spec.model import load_model_spec
from toolkit.spec.pipeline import PipelineSplit
from toolkit.spec.plan import resolve_plan

torch = pytest.importorskip("torch")
transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

# (layers, pp, vpp, first, last, embedding and loss counted in the split)
SPLITS = [
    (8, 2, 2, None, None, False),
    (24, 4, 3, None, None, False),
    (126, 16, 1, 7, 7, False),  # Llama 3 405B, no interleaving
    (126, 16, 8, None, None, True),  # Llama 3 405B with interleaving (first chunk: embedding only)
    (126, 16, 2, None, None, True),
    (30, 4, 2, 6, 8, False),  # uneven and interleaved: 6 / 8 / 8 / 8
    (30, 4, 2, None, 6, False),  # last only: 8 / 8 / 8 / 6
    (22, 4, 2, 4, None, False),  # first only: 4 / 6 / 6 / 6
    (14, 2, 1, 6, 8, False),  # no middle stage
    (30, 4, 1, None, None, True),  # 30 + 2 slots / 4 ranks: 7 / 8 / 8 / 7
    (30, 4, 2, None, None, True),
]
# Splits Megatron-Core refuses (TransformerConfig or get_num_layers_to_build)
REFUSED = [
    (126, 16, 2, 7, 7, False),  # 7 layers do not divide into 2 virtual stages
    (30, 4, 2, 6, 6, False),  # middle stages would hold 9 layers each: not divisible by vpp 2
    (30, 4, 1, 5, 6, False),  # 19 middle layers over 2 stages
    (24, 4, 1, None, None, True),  # 26 slots over 4 ranks
    (31, 4, 2, None, None, True),  # 33 slots over 4 ranks
    (12, 4, 1, 1, 11, False),  # first + last leave nothing for two middle stages
    (14, 2, 2, 6, 8, False),  # interleaved with no middle stage: get_transformer_layer_offset divides by zero
]


def megatron_chunks(layers, pp, vpp, first, last, counted):
    config = transformer_config.TransformerConfig(
        num_layers=layers, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, pipeline_dtype=torch.bfloat16,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=counted, account_for_loss_in_pipeline_split=counted,
    )
    chunks = []
    for rank in range(pp):
        per_rank = []
        for stage in range(vpp):
            vp_stage = stage if vpp > 1 else None
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
            per_rank.append(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank)))
        chunks.append(per_rank)
    return chunks


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layers, pp, vpp, first, last, counted", SPLITS)
def test_layers_of_every_rank_and_virtual_stage_match_megatron_core(layers, pp, vpp, first, last, counted):
    split = PipelineSplit(layers, pp, vpp, first, last, counted, counted)
    assert split.problem() is None
    ours = split.chunks()
    assert ours == megatron_chunks(layers, pp, vpp, first, last, counted)
    assert sorted(i for rank in ours for chunk in rank for i in chunk) == list(range(layers))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layers, pp, vpp, first, last, counted", REFUSED)
def test_splits_megatron_core_refuses_are_refused(layers, pp, vpp, first, last, counted):
    with pytest.raises((ValueError, AssertionError, ZeroDivisionError)):
        megatron_chunks(layers, pp, vpp, first, last, counted)
    assert PipelineSplit(layers, pp, vpp, first, last, counted, counted).problem() is not None


def test_llama3_405b_split_one_layer_fewer_on_the_first_and_last_rank():
    model = load_model_spec("llama-3.1-405b")
    plan = resolve_plan(model, 16384, backend="megatron", tp=8, pp=16, vpp=8, global_batch=2048, seq_len=8192,
                        account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    held = [len(stage_layers(model.num_layers, plan, s)) for s in range(16)]
    assert held == [7] + [8] * 14 + [7]
    assert stage_layers(model.num_layers, plan, 0)[:2] == [15, 31]  # chunk 0 of rank 0 is the embedding alone
    with pytest.raises(UserInputError) as refused:
        resolve_plan(model, 16384, backend="megatron", tp=8, pp=16, vpp=2, first_stage_layers=7, last_stage_layers=7,
                     global_batch=2048, seq_len=8192)
    assert refused.value.key == "--first-stage-layers" and "--vpp 2" in refused.value.message


@pytest.mark.parametrize("pp, vpp, micro_batches", [(4, 1, 8), (4, 1, 2), (4, 2, 8), (4, 3, 4), (16, 8, 16), (16, 4, 32)])
def test_peak_forwards_follow_megatron_warmup_counts(pp, vpp, micro_batches):
    """Rank r runs pp-r-1 (1F1B) or 2(pp-r-1)+(vpp-1)pp (interleaved) warm-up forwards, then one more, at most all."""
    for rank in range(pp):
        warmup = pp - rank - 1 if vpp == 1 else 2 * (pp - rank - 1) + (vpp - 1) * pp
        alive = peak_forwards(pp, vpp, rank, micro_batches)
        assert len(alive) == min(warmup + 1, micro_batches * vpp)
        # forwards run in groups of pp micro-batches through every virtual stage in turn
        first_group = min(pp, micro_batches, len(alive))
        assert alive[:first_group] == [0] * first_group
        if vpp > 1 and len(alive) > pp:
            assert alive[pp] == 1


def test_interleaving_holds_more_activations_than_1f1b_and_never_more_than_every_micro_batch():
    model = load_model_spec("llama-3.1-405b")
    common = dict(backend="megatron", tp=8, pp=16, seq_len=8192, sequence_parallel=True, distributed_optimizer=True,
                  account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    plain = estimate_stage_memory(model, resolve_plan(model, 16384, global_batch=4096, **common), 1)
    interleaved = estimate_stage_memory(model, resolve_plan(model, 16384, global_batch=4096, vpp=4, **common), 1)
    # rank 1 of 16: 15 micro-batches x 8 layers without interleaving; 2*14 + 3*16 + 1 = 77 chunks of 2 layers with
    assert interleaved.activations / plain.activations == pytest.approx(77 * 2 / (15 * 8), rel=1e-3)
    everything = estimate_stage_memory(model, resolve_plan(model, 16384, global_batch=2048, vpp=8, **common), 1)
    # 16 micro-batches per rank: warm-up (141 forwards) exceeds the 16 x 8 there are, so all 128 stay alive
    one = estimate_stage_memory(model, resolve_plan(model, 16384 * 16, global_batch=2048, vpp=1, **common), 1)
    assert everything.activations / one.activations == pytest.approx(16, rel=1e-3)


def test_search_tries_llama3_split_without_and_with_interleaving_and_megatron_accepts_each():
    splits = pipeline_splits(126, 16, megatron=True)
    assert splits == [
        (dict(first_stage_layers=7, last_stage_layers=7), [1]),
        (dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True), [2, 4, 8]),
    ]
    for split, vpps in splits:
        for vpp in vpps:
            first, last = split.get("first_stage_layers"), split.get("last_stage_layers")
            counted = split.get("account_for_embedding_in_pipeline_split", False)
            assert PipelineSplit(126, 16, vpp, first, last, counted, counted).chunks() == megatron_chunks(
                126, 16, vpp, first, last, counted)
    assert pipeline_splits(126, 16, megatron=False) == []  # DeepSpeed has no uneven split
