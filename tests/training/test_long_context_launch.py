"""Ulysses sequence parallelism trained for real on 2 CPU ranks (gloo): the generated accelerate.yaml's
parallelism_config launched by `accelerate launch`, with DeepSpeed's tiled MLP, tiled loss and activation offload on,
gives the per-step loss and gradient norm of a 1-rank run without any of them, and each rank's attention really sees
half of every sequence. (Torch context parallel on FSDP2 does not run on CPU: benchmarks/gpu_check.py runs it.)"""

import json
import sys
from pathlib import Path

import pytest

from helpers import TRAIN, free_port, run_logged, tiny_llama_config
from toolkit.backends.long_context import ATTENTION_RECORD_DIR, RECORD_ATTENTION_ENV

pytestmark = pytest.mark.launch
SEQ_LEN = 256  # 2 MLP tiles of the local 128 tokens (hidden 64), 4 loss tiles of a 2-sequence micro-batch
MODEL = tiny_llama_config(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=SEQ_LEN)
TRAINING = {"seq_len": SEQ_LEN, "global_batch": 4, "max_steps": 3, "save_steps": 100, "warmup_steps": 1}
# fp32, so that the only difference is the reduction order (all-to-all, the SP loss weighting, tiles)
PLAN = {"backend": "deepspeed", "zero": 2, "micro_batch": 2, "precision": "fp32"}


def _steps(out):
    return [row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in row]


@pytest.fixture(scope="module")
def reference(variant, tmp_path_factory):
    """One rank, no sequence parallelism, no tiling: the run the Ulysses one must equal."""
    recipe = variant("sp1", replace={"model": {"config": MODEL}}, training=TRAINING, plan=PLAN,
                     cluster={"gpus": 1, "gpus_per_node": 1})
    root = tmp_path_factory.mktemp("sp1")
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1", "--master_port", str(free_port()),
           *TRAIN, "--recipe", str(recipe), "--output-dir", str(root / "run")]
    rc = run_logged(cmd, root / "train.log", timeout=1800)
    assert rc == 0, (root / "train.log").read_text()[-4000:]
    return root / "run"


@pytest.fixture(scope="module")
def ulysses(variant, generated, launch):
    recipe = variant("sp2", replace={"model": {"config": MODEL}}, training=TRAINING,
                     plan={**PLAN, "sp": 2, "tiled_mlp": True, "tiled_loss": True, "recompute": "full",
                           "offload_activations": "cpu"})
    files = generated(recipe)
    run = launch("ulysses", "accelerate", recipe, config_dir=files, env={RECORD_ATTENTION_ENV: "1"})
    assert run.rc == 0 and (run.out / "metrics.jsonl").exists(), run.tail()
    return run


def test_ulysses_with_tiling_and_offload_equals_one_rank(reference, ulysses):
    ours, theirs = _steps(ulysses.out), _steps(reference)
    assert [row["step"] for row in ours] == [row["step"] for row in theirs] == [1, 2, 3]
    for mine, one_rank in zip(ours, theirs):
        assert mine["loss"] == pytest.approx(one_rank["loss"], rel=1e-5)
        # the gradient, not only the loss: Adam's update barely depends on its scale (long_context.ulysses_gradient)
        assert mine["grad_norm"] == pytest.approx(one_rank["grad_norm"], rel=1e-4)
    assert "tiled MLP: 2 decoder layers" in ulysses.log.read_text()


def test_each_rank_attention_sees_half_the_sequence(ulysses, reference):
    records = {path.name: json.loads(path.read_text()) for path in (ulysses.out / ATTENTION_RECORD_DIR).iterdir()}
    assert sorted(records) == ["rank0.json", "rank1.json"]
    for record in records.values():
        # every attention call of both layers, forward and (full recompute) the recomputed forward in backward
        calls = [length for lengths in record["forwards"] for length in lengths]
        assert len(calls) >= 2 * 2 * len(_steps(ulysses.out)) and set(calls) == {SEQ_LEN // 2}
        # transformers' sdpa entry is DeepSpeed's all-to-all wrapper: attention itself runs on the whole sequence
        assert record["attention_function"].startswith("deepspeed.runtime.sequence_parallel.ulysses_sp.")
    assert not (reference / ATTENTION_RECORD_DIR).exists()  # the debug record is off unless asked for
