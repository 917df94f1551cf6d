"""Packed documents without cross-talk, without a launch: two prefixes of documents of widely spread lengths, prepared
with `dmt data prepare --append-eod` and read through Megatron-Core's own GPTDataset / BlendedDataset (the toolkit's
build_datasets), then

- the formula of toolkit/estimate/packed_attention.py against the samples: the mean over the blend's samples of the
  sum of squared document pieces (the runs of position ids that restart at 0) is what the estimate predicts from the
  .idx files alone, within a few percent, for each prefix and for their weighted blend;
- transformers' own flash-attention path on the collator's batches: the micro-batch flattened to one row is one
  transformers takes the variable-length route for, and the cu_seqlens it makes of the position ids are exactly the
  document boundaries the end-of-document tokens mark (and the sample boundaries);
- `dmt estimate --data-recipe` counting those documents with flash_attention_2, the whole sequence with sdpa or
  before the data exists, and saying which in --explain; its MFU numerator is what a run's metrics count.
"""

import json
import random
from pathlib import Path

import numpy
import pytest
import yaml

from helpers import ROOT
from toolkit.cli.main import main

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE / "tokenizer"
SEQ_LEN, SAMPLES = 64, 1600
WORDS = ["data", "model", "token", "layer", "attention", "gradient", "shard", "pipeline", "rank", "kernel", "über",
         "naïve", "déjà", "x", "yz"]


def _corpus(path: Path, seed: int, mean_words: float) -> None:
    """JSON lines whose documents run from a word or two to several samples long (lognormal word counts)."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(700):
            words = max(1, int(rng.lognormvariate(0, 1.1) * mean_words))
            handle.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")


def _recipe(directory: Path, prefixes: list[tuple[Path, float]], attention: str = "flash_attention_2") -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / "tiny-llama-cpu.yaml").read_text())
    recipe["data"] = {"blend": [{"prefix": str(prefix), "weight": weight} for prefix, weight in prefixes],
                      "split": "1", "reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True,
                      "tokenizer": {"path": str(TOKENIZER)}}
    recipe["plan"]["attention"] = attention
    recipe["training"].update(seq_len=SEQ_LEN, global_batch=SAMPLES, max_steps=1)
    path = directory / f"{'-'.join(p.name for p, _ in prefixes)}-{attention}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two prefixes (short documents; long ones, many beyond a sample), prepared by `dmt data prepare`; a process
    group of one (Megatron-Core's BlendedDataset asks for the rank that builds its index cache)."""
    import torch.distributed as dist

    root = tmp_path_factory.mktemp("packed")
    dist.init_process_group("gloo", init_method=f"file://{root / 'rendezvous'}", rank=0, world_size=1)
    prefixes = []
    for name, seed, words in (("short", 1, 5), ("long", 2, 60)):
        corpus = root / f"{name}.jsonl"
        _corpus(corpus, seed, words)
        assert main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(TOKENIZER), "--output-prefix",
                     str(root / name), "--append-eod", "--workers", "1"]) == 0
        prefixes.append(root / name)
    yield root, prefixes
    dist.destroy_process_group()


def _samples(recipe_path: Path, out: Path):
    from toolkit.data.blend import build_datasets
    from toolkit.spec.recipe import load_recipe, recipe_vocab_size

    recipe = load_recipe(recipe_path)
    train, _ = build_datasets(recipe, SEQ_LEN, SAMPLES, out, recipe_vocab_size(recipe))
    return recipe, [train[i] for i in range(len(train))]


def _squared_pieces(position_ids: numpy.ndarray) -> int:
    starts = numpy.flatnonzero(position_ids == 0)
    return int((numpy.diff(numpy.append(starts, len(position_ids))) ** 2).sum())


@pytest.mark.parametrize("blend", [[("short", 1.0)], [("long", 1.0)], [("short", 3.0), ("long", 1.0)]],
                         ids=["short", "long", "blend-3-1"])
def test_the_formula_is_the_mean_squared_pieces_of_gptdatasets_samples(prepared, blend):
    from toolkit.planner.recipe import packed_attention, recipe_plan
    from toolkit.spec.recipe import recipe_model

    root, _ = prepared
    recipe_path = _recipe(root, [(root / name, weight) for name, weight in blend])
    recipe, samples = _samples(recipe_path, root / recipe_path.stem)
    assert len(samples) >= SAMPLES
    measured = numpy.mean([_squared_pieces(numpy.asarray(sample["position_ids"])) for sample in samples])
    predicted = packed_attention(recipe, recipe_plan(recipe, recipe_model(recipe), backend="deepspeed"))
    assert predicted.squared_pieces == pytest.approx(measured, rel=0.04)
    # the documents matter: the sequence's square is off by more than the tolerance, even for the long ones
    assert measured < 0.95 * SEQ_LEN ** 2


def test_transformers_flash_path_takes_the_flattened_batch_apart_at_the_documents(prepared):
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    from toolkit.compat.transformers_seams import flash_takes_documents_apart
    from toolkit.data.blend import hf_batch, hf_flat_batch

    root, prefixes = prepared
    recipe_path = _recipe(root, [(prefixes[0], 1.0)])
    _, samples = _samples(recipe_path, root / "flat")
    eod = json.loads(Path(f"{prefixes[0]}.dmt.json").read_text())["tokenizer"]["eod"]
    micro = samples[:4]
    rows = hf_batch(micro)
    # the micro-batch as rows: transformers' flash-attention code would run causal attention over each whole row
    assert rows["position_ids"].shape == (4, SEQ_LEN) and not flash_takes_documents_apart(rows["position_ids"])
    flat = hf_flat_batch(micro)
    assert {key: tuple(value.shape) for key, value in flat.items()} == {
        key: (1, 4 * SEQ_LEN) for key in ("input_ids", "labels", "shift_labels", "position_ids")}
    assert flash_takes_documents_apart(flat["position_ids"])
    (cu_seqlens, _), (longest, _) = prepare_fa_kwargs_from_position_ids(flat["position_ids"])
    # the boundaries, from the tokens alone: every sample's start, and the token after every end-of-document token
    tokens = flat["input_ids"][0].tolist()
    after_eod = {i + 1 for i, token in enumerate(tokens) if token == eod}
    expected = sorted({k * SEQ_LEN for k in range(4)} | after_eod | {4 * SEQ_LEN})
    assert cu_seqlens.tolist() == expected
    assert len(expected) > 4 + 2 and int(longest) == max(numpy.diff(expected))


def _estimate(capsys, *argv) -> dict:
    code = main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", str(SEQ_LEN), "--json",
                 "--explain", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_estimate_counts_the_documents_with_flash_attention_and_says_which_count(prepared, capsys, tmp_path):
    from toolkit.runtime.metrics import run_throughput
    from toolkit.spec.model import load_model_spec
    from toolkit.spec.plan import Plan

    root, prefixes = prepared
    recipe = _recipe(root, [(prefixes[0], 3.0), (prefixes[1], 1.0)])
    flash = _estimate(capsys, "--attention", "flash_attention_2", "--data-recipe", str(recipe))
    sdpa = _estimate(capsys, "--attention", "sdpa", "--data-recipe", str(recipe))
    plain = _estimate(capsys, "--attention", "flash_attention_2")
    missing = _recipe(tmp_path, [(tmp_path / "not-prepared-yet", 1.0)])
    absent = _estimate(capsys, "--attention", "flash_attention_2", "--data-recipe", str(missing))

    counted = {name: {e["component"]: e for e in report["explain"]}["attention_flops"]
               for name, report in (("flash", flash), ("sdpa", sdpa), ("plain", plain), ("absent", absent))}
    assert counted["flash"]["counts_documents"] and counted["flash"]["difference"].startswith("per document")
    assert 0 < flash["packed_attention"]["squared_pieces"] < 0.9 * SEQ_LEN ** 2
    assert counted["flash"]["flops_per_token"] < 0.9 * counted["flash"]["rule_of_thumb_value"]
    assert "sdpa masks the documents apart over the whole score matrix" in counted["sdpa"]["difference"]
    assert "not readable here" in counted["absent"]["difference"] and "not-prepared-yet" in counted["absent"]["difference"]
    assert "no packed documents given" in counted["plain"]["difference"] and "packed_attention" not in plain
    for name in ("sdpa", "plain", "absent"):
        assert not counted[name]["counts_documents"]
        assert counted[name]["flops_per_token"] == counted[name]["rule_of_thumb_value"]
    # fewer attention FLOPs: less compute time, and MFU counts the documents' work (the same convention as the rows)
    assert flash["step_time_breakdown_s"]["compute_s"] < plain["step_time_breakdown_s"]["compute_s"]
    assert sdpa["step_time_s"] == absent["step_time_s"] == plain["step_time_s"]
    # a run's metrics count the FLOPs its prediction counted
    plan = Plan.model_validate(flash["plan"])
    throughput = run_throughput(load_model_spec("llama-3.1-8b"), plan, flash, "gpu")
    assert throughput.flops_per_step == pytest.approx(
        flash["tflops_per_gpu"] * 1e12 * flash["step_time_s"] * plan.gpus, rel=1e-9)


CACHE_DAMAGE = {  # what a shared or copied index cache may hold -> the words of the one line
    "shuffled samples out of range": ("GPTDataset-train-shuffle_index", lambda a: a + 10**6, "outside"),
    "documents out of range": ("GPTDataset-train-document_index", lambda a: a - 5, "outside"),
    "blended datasets out of range": ("BlendedDataset-train-dataset_index", lambda a: a + 7, "outside"),
    "floats for indices": ("GPTDataset-train-sample_index", lambda a: a.astype(numpy.float64), "float64"),
    "a FIFO for an index": ("GPTDataset-train-shuffle_index", None, "a FIFO"),
}


@pytest.mark.parametrize("case", sorted(CACHE_DAMAGE))
def test_a_damaged_index_cache_is_one_line_naming_it_not_a_hang_or_a_traceback(prepared, tmp_path, case):
    """Megatron-Core trusts its index cache: a FIFO under a cache file's name blocked every rank (before any
    watchdog), and an index out of range ended in an IndexError inside a data loader worker. Each is refused in one
    line naming data.cache_dir and the file; deleting the cache builds it again."""
    import os
    import shutil

    from toolkit.errors import UserInputError

    name, damage, says = CACHE_DAMAGE[case]
    root, _ = prepared
    recipe_path = _recipe(tmp_path, [(root / "short", 3.0), (root / "long", 1.0)])
    _samples(recipe_path, tmp_path / "run")  # builds the cache
    path = min((tmp_path / "run" / "data_cache").rglob(f"*{name}.npy"))  # the first of the blend's
    if damage is None:
        path.unlink()
        os.mkfifo(path)
    else:
        numpy.save(path, damage(numpy.load(path)))
    with pytest.raises(UserInputError) as refused:
        _samples(recipe_path, tmp_path / "run")
    assert refused.value.key == "data.cache_dir" and path.name in str(refused.value), refused.value
    assert says in str(refused.value) and "\n" not in str(refused.value)
    shutil.rmtree(tmp_path / "run" / "data_cache")
    assert len(_samples(recipe_path, tmp_path / "run")[1]) >= SAMPLES
