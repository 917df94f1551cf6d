"""The global sample order of a blend without a launch: each step's samples are the same at any data-parallel size,
as Megatron-Core's loop deals them (rank_samples) and as Accelerate deals the HF Trainer's micro-batches
(its own BatchSamplerShard over ConsumedSampler), from the start and after a resume on another number of ranks; and
the split strings Megatron's --split takes."""

import os

import pytest

from toolkit.data.blend import ConsumedSampler, RankSteps, rank_samples, step_samples
from toolkit.data.split import megatron_split, split_shares

GLOBAL_BATCH, MICRO, STEPS = 16, 2, 6


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_megatron_ranks_share_out_each_steps_samples_at_any_dp_size(dp):
    for step in range(1, STEPS + 1):
        shares = [list(rank_samples(step, GLOBAL_BATCH, rank, dp)) for rank in range(dp)]
        assert sorted(i for share in shares for i in share) == list(step_samples(step, GLOBAL_BATCH))
    last_rank = dp - 1
    loader = RankSteps(GLOBAL_BATCH, last_rank, dp, 3, STEPS)
    assert len(loader) == STEPS - 2 and next(iter(loader)) == list(rank_samples(3, GLOBAL_BATCH, last_rank, dp))


def _hf_steps(processes: int, consumed: int, length: int) -> list[list[int]]:
    """The samples of each optimizer step as Accelerate deals the HF Trainer's micro-batches out to `processes`
    ranks (BatchSamplerShard, as accelerator.prepare builds it), each rank accumulating its micro-batches."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    accumulation = GLOBAL_BATCH // (MICRO * processes)
    batches = BatchSampler(ConsumedSampler(length, consumed), MICRO, drop_last=False)
    per_rank = [list(BatchSamplerShard(batches, processes, rank)) for rank in range(processes)]
    steps = []
    for step in range(len(per_rank[0]) // accumulation):
        micro = [b for rank in per_rank for b in rank[step * accumulation:(step + 1) * accumulation]]
        steps.append(sorted(i for batch in micro for i in batch))
    return steps


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_the_hf_trainer_reads_the_same_global_batches_at_any_dp_size(processes):
    steps = _hf_steps(processes, 0, STEPS * GLOBAL_BATCH)
    assert steps == [list(step_samples(step, GLOBAL_BATCH)) for step in range(1, STEPS + 1)]


@pytest.mark.parametrize("saved_on,resumed_on", [(2, 4), (4, 1), (2, 2)])
def test_a_resume_on_another_dp_size_reads_on_from_the_global_count(saved_on, resumed_on):
    """The checkpoint's consumed samples are global: the first resumed step is the uninterrupted run's next one,
    whatever the number of ranks that saved it."""
    saved_at = 2
    consumed = len(sum(_hf_steps(saved_on, 0, STEPS * GLOBAL_BATCH)[:saved_at], []))
    assert consumed == saved_at * GLOBAL_BATCH
    resumed = _hf_steps(resumed_on, consumed, STEPS * GLOBAL_BATCH)
    assert resumed == [list(step_samples(step, GLOBAL_BATCH)) for step in range(saved_at + 1, STEPS + 1)]


def test_the_manifest_counts_consumed_samples_globally(tmp_path):
    from toolkit.checkpoint.manifest import consumed_samples, data_position, write_manifest

    identity = {"global_batch": GLOBAL_BATCH, "seq_len": 64, "seed": 7, "data": "x"}
    checkpoint = tmp_path / "checkpoint-5"
    checkpoint.mkdir()
    write_manifest(checkpoint, step=5, world_size=2, layout={}, fmt="test",
                   extra={"run": identity, **data_position(5, identity)})
    assert consumed_samples(checkpoint) == 5 * GLOBAL_BATCH and consumed_samples(None) == 0


@pytest.mark.parametrize("split,shares", [("969,30,1", [969, 30, 1]), ("98, 2", [98, 2, 0]), ("1", [1, 0, 0]),
                                          ("0.9,0.1,0", [0.9, 0.1, 0])])
def test_a_split_is_megatrons_three_shares(split, shares):
    assert split_shares(split) == shares
    assert megatron_split(split) == ",".join(f"{share:g}" for share in shares)


@pytest.mark.parametrize("split", ["", "a,b", "1,2,3,4", "0,0,0", "-1,2", "1,,2", "nan,1", "inf,1"])
def test_a_malformed_split_is_refused(split):
    with pytest.raises(ValueError, match="comma-separated non-negative numbers"):
        split_shares(split)


def test_an_index_cache_holding_pickled_objects_is_refused_before_megatron_loads_it(tmp_path):
    """Megatron-Core reads its index cache with numpy.load(allow_pickle=True); a cache someone else filled must hold
    plain arrays only: an object array (a pickle, which could run code when loaded) is refused in one line, unread."""
    import numpy

    from helpers import bounded
    from toolkit.data.indexed import check_plain_arrays
    from toolkit.errors import UserInputError

    cache = tmp_path / "cache" / "GPTDataset_indices"
    cache.mkdir(parents=True)
    numpy.save(cache / "abc-GPTDataset-train-document_index.npy", numpy.arange(10, dtype=numpy.int32))
    check_plain_arrays(tmp_path / "cache", "data.cache_dir")  # what Megatron-Core writes passes
    planted = cache / "abc-GPTDataset-train-sample_index.npy"
    numpy.save(planted, numpy.array([{"not": "an index"}], dtype=object), allow_pickle=True)
    with pytest.raises(UserInputError, match="holds pickled Python objects") as refused:
        check_plain_arrays(tmp_path / "cache", "data.cache_dir")
    assert refused.value.key == "data.cache_dir" and str(planted) in str(refused.value)
    planted.write_bytes(b"not numpy")
    with pytest.raises(UserInputError, match="not a readable numpy index"):
        check_plain_arrays(tmp_path / "cache", "data.cache_dir")
    planted.unlink()
    os.mkfifo(planted)  # under a cache file's name it would block every rank that opens it, before any watchdog
    # a check that opened it would block for ever: it runs in a forked child the fuzz files' hang guard kills after
    # FUZZ_HANG_GUARD_S (120 s; the refusal takes milliseconds), which fails the case instead of hanging CI
    code, _, err, _ = bounded(lambda: check_plain_arrays(tmp_path / "cache", "data.cache_dir") or 0)
    assert code == 2 and len(err) == 1, err
    assert "data.cache_dir" in err[0] and str(planted) in err[0] and "is a FIFO" in err[0], err


def test_megatrons_index_cache_reads_load_no_pickle_swapped_in_after_the_check(tmp_path):
    """check_plain_arrays reads the cache before Megatron-Core does; a file another job swaps in between is still
    never unpickled: GPTDataset's and BlendedDataset's numpy.load(allow_pickle=True) load without pickles."""
    import pickle

    import numpy
    from megatron.core.datasets import blended_dataset, gpt_dataset

    from toolkit.compat.megatron_datasets_seams import index_cache_without_pickles

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    swapped, plain = tmp_path / "swapped-sample_index.npy", tmp_path / "document_index.npy"
    swapped.write_bytes(pickle.dumps(Payload()))
    numpy.save(plain, numpy.arange(10, dtype=numpy.int32))
    index_cache_without_pickles()
    index_cache_without_pickles()  # idempotent: one wrapper, not two
    for module in (gpt_dataset, blended_dataset):
        with pytest.raises(ValueError, match="pickled"):
            module.numpy.load(swapped, allow_pickle=True, mmap_mode="r")  # as Megatron-Core calls it
        assert not marker.exists()
        assert module.numpy.load(plain, allow_pickle=True, mmap_mode="r").tolist() == list(range(10))
        assert module.numpy.int64 is numpy.int64 and type(module.numpy.numpy) is type(numpy)
