"""A blend of two prepared prefixes trained for real on 2 CPU ranks with each backend (Megatron-Core natively,
DeepSpeed and FSDP2 through the HF Trainer): every backend sees the same samples at every step (each step's data
fingerprint in metrics.jsonl, a canonical digest of the global batch's token rows), and a run killed after a save
resumes reading exactly the samples after the checkpoint's consumed count, nothing before it (the reads are
recorded, so the resume's cost cannot grow with the step it resumes at), the same samples the uninterrupted runs saw."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, TRAIN, free_port

pytestmark = pytest.mark.launch

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE / "tokenizer"
CORPUS = ROOT / "recipes" / "data" / "tiny_corpus.txt"
STEPS, SAVE_AT, KILL_AT, GLOBAL_BATCH = 8, 4, 6, 16


def _prepare(directory: Path) -> list[Path]:
    """Two prefixes of the tiny corpus's halves, through `dmt data prepare`."""
    from toolkit.cli.main import main

    lines = CORPUS.read_text().splitlines()
    prefixes = []
    for name, part in (("first", lines[: len(lines) // 2]), ("second", lines[len(lines) // 2:])):
        text = directory / f"{name}.txt"
        text.write_text("\n".join(part) + "\n")
        prefix = directory / name
        assert main(["data", "prepare", "--input", str(text), "--tokenizer", str(TOKENIZER), "--output-prefix",
                     str(prefix), "--append-eod", "--workers", "1"]) == 0
        prefixes.append(prefix)
    return prefixes


def _recipe(directory: Path, base: str, prefixes: list[Path]) -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / base).read_text())
    recipe["data"] = {"blend": [{"prefix": str(prefixes[0]), "weight": 3}, {"prefix": str(prefixes[1]), "weight": 1}],
                      "split": "95,5,0", "reset_position_ids": True, "reset_attention_mask": True,
                      "eod_mask_loss": True, "tokenizer": {"path": str(TOKENIZER)}}
    recipe["training"].update(max_steps=STEPS, save_steps=SAVE_AT, warmup_steps=1)
    path = directory / base
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _torchrun(recipe: Path, out: Path, log: Path, env: dict, *flags: str) -> int:
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           *TRAIN, "--recipe", str(recipe), "--output-dir", str(out), *flags]
    with open(log, "w") as handle:
        return subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=1800,
                              env=dict(os.environ, HF_HUB_OFFLINE="1", **env)).returncode


def _steps(out: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r and r.get("loss") is not None}


def _reads(directory: Path) -> list[int]:
    return sorted(int(line) for file in directory.glob("*.txt") for line in file.read_text().split())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Megatron-Core, FSDP2 and DeepSpeed on the same blend; DeepSpeed also killed at step KILL_AT (after the save at
    SAVE_AT) and resumed with its sample reads recorded."""
    root = tmp_path_factory.mktemp("blend")
    prefixes = _prepare(root)
    done = {}
    for name, base in (("megatron", "tiny-llama-megatron-cpu.yaml"), ("fsdp", "tiny-llama-fsdp-cpu.yaml"),
                       ("deepspeed", "tiny-llama-cpu.yaml")):
        out = root / name
        rc = _torchrun(_recipe(root, base, prefixes), out, root / f"{name}.log", {})
        done[name] = (out, rc, root / f"{name}.log")
    recipe, out = root / "tiny-llama-cpu.yaml", root / "resumed"
    killed = _torchrun(recipe, out, root / "killed.log", {"DMT_FAULT": f"kill@rank=0,step={KILL_AT},phase=train"})
    reads = root / "reads"
    reads.mkdir()
    rc = _torchrun(recipe, out, root / "resumed.log", {"DMT_DATA_READS": str(reads)}, "--resume", "latest")
    done["resumed"] = (out, rc, root / "resumed.log")
    return done, killed, reads


def test_a_blend_trains_with_every_backend(runs):
    done, _, _ = runs
    for name, (out, rc, log) in done.items():
        steps = _steps(out)
        assert rc == 0 and sorted(steps) == list(range(1, STEPS + 1)), (name, log.read_text()[-3000:])
        assert steps[STEPS]["loss"] < steps[1]["loss"], name
        assert all(record["data_wait_s"] >= 0 for record in steps.values())


def test_every_backend_sees_the_same_samples_in_the_same_order(runs):
    done, _, _ = runs
    order = {name: [_steps(out)[step]["data_sha"] for step in range(1, STEPS + 1)]
             for name, (out, _, _) in done.items()}
    assert order["megatron"] == order["fsdp"] == order["deepspeed"], order
    assert len(set(order["megatron"])) == STEPS  # every step its own samples


def test_a_resume_reads_only_the_samples_after_the_checkpoint_and_they_are_the_uninterrupted_ones(runs):
    done, killed, reads = runs
    out, rc, log = done["resumed"]
    assert killed != 0 and rc == 0, log.read_text()[-3000:]
    manifest = json.loads((out / f"checkpoint-{SAVE_AT}" / "dmt_manifest.json").read_text())
    assert manifest["consumed_samples"] == SAVE_AT * GLOBAL_BATCH
    # nothing before the consumed count is read, each later sample exactly once: the resume costs the same at any step
    assert _reads(reads) == list(range(SAVE_AT * GLOBAL_BATCH, STEPS * GLOBAL_BATCH))
    resumed, uninterrupted = _steps(out), _steps(done["deepspeed"][0])
    assert [resumed[s]["data_sha"] for s in range(SAVE_AT + 1, STEPS + 1)] == \
        [uninterrupted[s]["data_sha"] for s in range(SAVE_AT + 1, STEPS + 1)]
