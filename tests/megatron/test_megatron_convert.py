"""`dmt convert hf-to-megatron | megatron-to-hf | check` on tiny random models of every mapped family: the round
trip through a Megatron-Core dist checkpoint gives back every HF tensor bit for bit, real Megatron-Core at TP=2 and
PP=2 (gloo) gives the HF logits, and a checkpoint saved by Megatron-Core training converts to a loadable HF model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_helpers import BIN, STEPS

pytestmark = pytest.mark.launch
HERE = Path(__file__).resolve().parent
# family:tp:pp[:ep[:etp]]; the MoE families also at the experts' layouts
ROUND_TRIPS = ["llama:2:1", "llama:1:2", "llama:2:2", "mistral:2:2", "qwen2:2:2", "qwen3:2:2", "mixtral:2:2",
               "mixtral:1:2:2", "qwen3_moe:2:2", "qwen3_moe:2:1:4", "deepseek_v3:2:2", "deepseek_v3:1:2:4",
               "gpt_oss:2:2:1:1", "gpt_oss:1:2:4", "gpt2:2:2"]  # gpt_oss's biased experts: ETP 1 only


def dmt(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dmt"), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    work = tmp_path_factory.mktemp("convert")
    result = subprocess.run([sys.executable, str(HERE / "convert_roundtrip.py"), "--work", str(work),
                             "--cases", ",".join(ROUND_TRIPS)], capture_output=True, text=True, timeout=900)
    assert (work / "roundtrip.json").is_file(), result.stderr[-4000:]
    return work, json.loads((work / "roundtrip.json").read_text())


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_hf_megatron_hf_round_trip_is_bitwise(round_trips, case):
    _, results = round_trips
    assert results[case]["differing"] == [], results[case]
    assert results[case]["tensors"] > 10 and results[case]["config_equal"]
    assert results[case]["padded_vocab"] == 128 * int(case.split(":")[1]) * -(-300 // (128 * int(case.split(":")[1])))
    tp, pp, *experts = (int(v) for v in case.split(":")[1:])
    ep = experts[0] if experts else 1
    layout = results[case]["layout"]
    assert (layout["tp"], layout["pp"], layout["ep"], layout["etp"]) == (tp, pp, ep, experts[1] if experts[1:] else tp)


@pytest.mark.parametrize("family, flags", [("llama", ("--tp", "2")), ("gpt2", ("--pp", "2")),
                                           ("mixtral", ("--tp", "2", "--ep", "2", "--etp", "1")),
                                           ("qwen3_moe", ("--ep", "2")), ("deepseek_v3", ("--ep", "2")),
                                           ("gpt_oss", ("--ep", "2"))])
def test_megatron_core_at_tp2_pp2_or_ep2_gives_the_hf_logits(round_trips, family, flags):
    """Real Megatron-Core, 2 gloo ranks, loads the converted checkpoint resharded and runs the forward pass (the
    pipeline schedule for PP; at EP 2 each rank loads half of the experts and the alltoall dispatcher routes tokens
    between them, for mixtral folded over TP 2 with the experts unsplit by TP, ETP 1, on the same 2 ranks); gpt2
    also ties the output layer to the embedding across the two stages."""
    work, _ = round_trips
    layout = {"tp": 1, "pp": 1, "ep": 1, **{flag.strip("-"): int(value) for flag, value in zip(flags[::2], flags[1::2])}}
    result = dmt("convert", "check", str(work / family / "hf"), str(work / family / "mcore-tp2-pp2"), *flags, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["passed"] and {k: report[k] for k in layout} == layout
    assert report["max_abs_diff"] < 1e-5 and report["logit_scale"] > 0.1, report


def test_each_stored_chunk_holds_only_its_own_bytes(round_trips):
    """A SwiGLU linear_fc1 is saved as its gate and up halves (Megatron-Core's apply_swiglu_sharded_factory), each a
    view of the fused tensor; torch.save writes a view's whole storage, so each half carried the fused tensor along
    (+27% on the tiny Llama). Megatron-Core's own save, through DCP's writer, copies views first: so does ours."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from toolkit.checkpoint.safe_load import read_dcp_metadata

    work, _ = round_trips
    checkpoints = sorted(work.glob("*/mcore-*"))
    assert len(checkpoints) == len(ROUND_TRIPS)
    for ckpt in checkpoints:
        metadata = read_dcp_metadata(ckpt)
        for index, stored in metadata.storage_data.items():
            meta = metadata.state_dict_metadata[index.fqn]
            if isinstance(meta, TensorStorageMetadata):
                chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
                nbytes = math.prod(chunk.sizes) * meta.properties.dtype.itemsize
                assert stored.length < nbytes + 4096, (ckpt, index.fqn, tuple(index.offset), stored.length, nbytes)


def test_a_megatron_training_checkpoint_converts_to_a_loadable_hf_model(layout_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = layout_run("tp2").out / f"checkpoint-{STEPS}"
    assert (ckpt / "config.json").is_file(), "training saves the model's HF config beside the weights"
    out = tmp_path / "hf"
    result = dmt("convert", "megatron-to-hf", str(ckpt), str(out), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == json.loads(result.stdout.strip().splitlines()[-1])["parameters"]
    assert torch.isfinite(model.lm_head.weight).all()
    check = dmt("convert", "check", str(out), str(ckpt), "--tp", "2", "--json")
    assert check.returncode == 0 and json.loads(check.stdout.strip().splitlines()[-1])["passed"], check.stderr[-3000:]


def test_verify_deep_finds_nan_in_the_optimizer_state_of_a_training_checkpoint(layout_run, tmp_path):
    """Adam's exp_avg_sq of one weight gone NaN in a real Megatron-Core training checkpoint (DP=2, distributed
    optimizer): the weights are finite, the resumed run would not be."""
    import shutil

    import numpy as np
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from toolkit.checkpoint.dcp import DistCheckpointReader
    from toolkit.checkpoint.safe_load import read_dcp_metadata

    ckpt = tmp_path / "ckpt"
    shutil.copytree(layout_run("dp2").out / f"checkpoint-{STEPS}", ckpt)
    assert dmt("ckpt", "verify", str(ckpt), "--deep").returncode == 0
    metadata = read_dcp_metadata(ckpt)
    key = next(k for k in metadata.state_dict_metadata if k.startswith("optimizer.") and "exp_avg_sq" in k)
    chunk = metadata.state_dict_metadata[key].chunks[0]
    index = MetadataIndex(key, chunk.offsets)
    values = DistCheckpointReader(ckpt, metadata=metadata).load_chunk(index, chunk.sizes).numpy()
    stored = metadata.storage_data[index]
    with open(ckpt / stored.relative_path, "r+b") as handle:  # the chunk's data lies uncompressed in its archive
        handle.seek(stored.offset)
        start = stored.offset + handle.read(stored.length).index(values.tobytes())
        handle.seek(start)
        handle.write(np.array([np.nan], dtype=values.dtype).tobytes())
    result = dmt("ckpt", "verify", str(ckpt), "--deep")
    assert result.returncode == 1 and f"tensor {key} holds 1 NaN/Inf values" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr


def test_megatron_to_hf_shards_like_save_pretrained(round_trips, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    work, _ = round_trips
    out = tmp_path / "hf"
    result = dmt("convert", "megatron-to-hf", str(work / "llama" / "mcore-tp2-pp2"), str(out), "--max-shard-size",
                 "100KB", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["shards"] > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    converted = {}
    for shard in sorted(set(index["weight_map"].values())):
        converted.update(load_file(out / shard))
    original = load_file(work / "llama" / "hf" / "model.safetensors")
    assert set(converted) == set(index["weight_map"]) == set(original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
    AutoModelForCausalLM.from_pretrained(out)  # HF reads the index


@pytest.mark.parametrize("args, says", [
    (("hf-to-megatron", "{hf}", "{new}", "--tp", "3"), "--tp: 3 must divide attention heads (4)"),
    (("hf-to-megatron", "{missing}", "{new}"), "HF_DIR: "),
    (("hf-to-megatron", "{hf}", "{existing}"), "OUT_DIR: "),
    (("megatron-to-hf", "{hf}", "{new}"), "MEGATRON_DIR: "),
    (("check", "{hf}", "{other}"), "MEGATRON_DIR: "),
    (("check", "{bare}", "{existing}"), "HF_DIR: "),  # a config without weights: refused before any model is built
])
def test_bad_input_is_one_line_and_exit_2(round_trips, tmp_path, args, says):
    work, _ = round_trips
    names = {"hf": work / "llama" / "hf", "new": tmp_path / "new", "missing": tmp_path / "missing",
             "existing": work / "llama" / "mcore-tp2-pp1", "other": work / "gpt2" / "mcore-tp2-pp2",
             "bare": tmp_path / "bare"}
    names["bare"].mkdir()
    (names["bare"] / "config.json").write_text((names["hf"] / "config.json").read_text())
    result = dmt("convert", *(a.format(**names) for a in args))
    lines = [line for line in result.stderr.splitlines() if line.startswith("dmt convert: error:")]
    assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "new").exists()
