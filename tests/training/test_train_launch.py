"""toolkit/train.py under `deepspeed` (ZeRO 1, 2, 3), `accelerate launch` (ZeRO 2, 3) and torchrun (through the
generated launch.sh), 2 CPU ranks, tiny recipe: each run exits 0, its loss falls, metrics.jsonl and a verified
checkpoint are on disk. Runs are judged by what they wrote as well as by the exit code (gloo may abort at exit).
The ZeRO-3 launch trains a tiny Qwen3-MoE instead: its experts are ZeRO-3 partitions like every other parameter, and
its checkpoint converts to HF as DeepSpeed's zero_to_fp32 reconstructs it."""

import json
import os
import subprocess

import pytest

from helpers import PROFILED, PYTHON_TRAIN, TINY, TINY_MOE, assert_profiled, assert_step_cost, wandb_history
from toolkit.checkpoint.manifest import read_manifest, resolve_latest
from toolkit.checkpoint.verify import verify
from toolkit.runtime.metrics import read_metrics, read_run_record

pytestmark = pytest.mark.launch
METRIC_KEYS = {"step", "loss", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s", "mfu", "data_wait_s"}
STEPS = 20  # enough for the tiny corpus's loss to fall clearly, few enough for a loaded 2-core machine
# A generated DeepSpeed JSON carries the recipe's schedule (total_num_steps 30): a launch with it keeps max_steps,
# since train.py refuses a --max-steps that disagrees with an explicit total_num_steps (HF Trainer would too)
RECIPE_STEPS = 30


def assert_trained(run, steps: int = STEPS, zero: int | None = None) -> list[dict]:
    records = read_metrics(run.out)
    assert [r["step"] for r in records] == list(range(1, steps + 1)), run.tail()
    prediction = read_run_record(run.out)
    for record in records:
        assert METRIC_KEYS <= set(record)
        assert record["loss"] > 0 and record["grad_norm"] > 0 and record["learning_rate"] >= 0
        assert_step_cost(record, prediction)
    assert all(r["tokens_per_s"] > 0 for r in records[1:])
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 1.0, (first, last)  # the tiny corpus is learnable: the loss clearly falls
    latest = resolve_latest(run.out)
    assert latest is not None and latest.name == f"checkpoint-{steps}"
    report = verify(latest)
    assert report.ok and report.manifest, report.problems
    if zero is not None:
        assert read_manifest(latest)["layout"]["zero"] == zero
    assert run.rc == 0, run.tail()
    return records


@pytest.fixture(scope="module")
def wandb_recipe(variant):
    return variant("tiny-wandb", training={"report_to": ["wandb"]})


MOE_FAMILY = "qwen3_moe"  # what the ZeRO-3 launch trains (transformers' fused 3-D expert tensors, a router)


@pytest.fixture(scope="module")
def moe_recipe(variant):
    return variant(f"tiny-{MOE_FAMILY}", replace={"name": f"tiny-{MOE_FAMILY}-cpu",
                                                  "model": {"config": TINY_MOE[MOE_FAMILY]}})


def deepspeed_run(launch, wandb_recipe, zero: int, moe_recipe=None):
    if zero == 2:  # this one also logs to wandb with no API key anywhere: it must go offline by itself
        env = {"WANDB_MODE": None, "WANDB_API_KEY": None, "NETRC": os.devnull}
        return launch("ds-zero2", "deepspeed", wandb_recipe, "--zero", "2", "--max-steps", str(STEPS), env=env)
    if zero == 3:  # a tiny MoE model, its experts ZeRO-3 partitioned as ordinary parameters (no expert parallelism)
        return launch(f"ds-zero3-{MOE_FAMILY}", "deepspeed", moe_recipe, "--zero", "3", "--max-steps", str(STEPS))
    profiled = ("--profile-steps", "-".join(PROFILED)) if zero == 1 else ()  # the DeepSpeed launch that profiles
    return launch(f"ds-zero{zero}", "deepspeed", TINY, "--zero", str(zero), "--max-steps", str(STEPS), *profiled)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_deepspeed_launcher_trains_and_checkpoints(launch, wandb_recipe, moe_recipe, zero):
    run = deepspeed_run(launch, wandb_recipe, zero, moe_recipe)
    assert_trained(run, zero=zero)
    if zero == 3:
        assert_experts_zero3_partitioned(resolve_latest(run.out))


def _zero3_rank_files(checkpoint) -> tuple[list[dict], list[dict]]:
    """Each rank's model-state and optimizer-state objects of a ZeRO-3 checkpoint, as DeepSpeed saved them."""
    import torch

    tag = checkpoint / (checkpoint / "latest").read_text().strip()

    def load(pattern: str) -> list[dict]:  # the suite's own run: its pickles are DeepSpeed's objects
        return [torch.load(f, map_location="cpu", weights_only=False) for f in sorted(tag.glob(pattern))]

    return load("zero_pp_rank_*_mp_rank_00_model_states.pt"), load("*_zero_pp_rank_*_mp_rank_00_optim_states.pt")


def assert_experts_zero3_partitioned(checkpoint) -> None:
    """What each of the 2 ranks held when it saved, in DeepSpeed's own files: every expert tensor (transformers' fused
    [experts, ...] parameters) is among ZeRO-3's parameters, its 16-bit module copy an empty placeholder (the rank
    held a partition, not the tensor), and each rank's fp32 master partition is half of every parameter, the experts'
    included (ceil(numel / 2) each). A model whose experts escaped ZeRO (kept whole on every rank) fails here."""
    import math

    model_states, optim_states = _zero3_rank_files(checkpoint)
    assert len(model_states) == len(optim_states) == 2
    shapes = {name: shape for group in model_states[0]["param_shapes"] for name, shape in group.items()}
    experts = [name for name in shapes if ".mlp.experts." in name]
    config = TINY_MOE[MOE_FAMILY]
    assert len(experts) == 2 * config["num_hidden_layers"], sorted(shapes)  # gate_up_proj and down_proj per layer
    assert all(shapes[name][0] == config["num_experts"] and len(shapes[name]) == 3 for name in experts), shapes
    half = sum(math.ceil(math.prod(shape) / 2) for shape in shapes.values())
    for model_state, optim_state in zip(model_states, optim_states):
        assert model_state["dp_world_size"] == 2
        assert all(model_state["module"][name].numel() == 0 for name in experts)
        zero = optim_state["optimizer_state_dict"]
        assert zero["zero_stage"] == 3 and zero["partition_count"] == 2
        assert sum(flat.numel() for flat in zero["fp32_flat_groups"]) == half


def test_zero3_moe_checkpoint_converts_as_zero_to_fp32_and_transformers_read_it(launch, wandb_recipe, moe_recipe,
                                                                                  tmp_path, capsys):
    """`dmt convert zero-to-hf` of the MoE run's last checkpoint: the tensors of DeepSpeed's zero_to_fp32, bit for bit,
    under the names the model trained with (transformers' fused experts); from_pretrained loads them unchanged, and
    they are the 16-bit weights transformers itself saved beside them (per-expert names on disk), cast back."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from toolkit.cli.main import main

    checkpoint = resolve_latest(deepspeed_run(launch, wandb_recipe, 3, moe_recipe).out)
    out = tmp_path / "hf"
    assert main(["convert", "zero-to-hf", str(checkpoint), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_stage"] == 3
    ours = load_file(str(out / "model.safetensors"))
    reference = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    assert sorted(ours) == sorted(reference) and any(".mlp.experts.gate_up_proj" in name for name in ours)
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert ours[name].numpy().tobytes() == tensor.detach().contiguous().numpy().tobytes(), name
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert sorted(loaded) == sorted(ours) and all(torch.equal(loaded[k], ours[k]) for k in ours)
    saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).state_dict()  # model.safetensors
    assert all(torch.equal(saved[k], ours[k].bfloat16()) for k in ours)


def test_profiled_deepspeed_steps_write_traces_and_a_breakdown_that_adds_up(launch, wandb_recipe):
    breakdown = assert_profiled(deepspeed_run(launch, wandb_recipe, 1).out)
    assert breakdown["measured"]["optimizer_s"] > 0  # DeepSpeed's optimizer step, inside the profiled steps


def test_cpu_ranks_leave_no_deepspeed_shared_memory_behind(launch, wandb_recipe):
    # DeepSpeed's CPU all-reduce creates a 66 MiB /dev/shm segment per rank and never unlinks it; train.py does
    run = deepspeed_run(launch, wandb_recipe, 1)
    assert run.rc == 0, run.tail()
    assert run.shm_left == []


def test_wandb_logs_offline_when_no_api_key_is_configured(launch, wandb_recipe):
    """...and it gets the figures metrics.jsonl has, step by step: loss, step time, tokens/s, data-loader wait and
    the MFU (against the host peak the run was predicted with)."""
    run = deepspeed_run(launch, wandb_recipe, 2)
    offline_runs = list((run.out / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1, run.tail()  # rank 0 only, under the output directory
    assert list(offline_runs[0].glob("*.wandb"))
    logged = {row["train/global_step"]: row for row in wandb_history(run.out) if "train/loss" in row}
    records = read_metrics(run.out)
    assert sorted(logged) == [r["step"] for r in records]
    for record in records:
        row = logged[record["step"]]
        for key in ("loss", "step_time_s", "tokens_per_s", "data_wait_s", "mfu"):
            assert row[f"train/{key}"] == pytest.approx(record[key]), key


def test_accelerate_launch_with_generated_zero2_config(launch, generated):
    config = generated(TINY, "--zero", "2")
    run = launch("acc-zero2", "accelerate", TINY, config_dir=config)
    assert_trained(run, RECIPE_STEPS, zero=2)


def test_a_max_steps_that_contradicts_the_deepspeed_schedule_is_refused(launch, generated):
    config = generated(TINY, "--zero", "2")
    run = launch("acc-zero2-steps", "accelerate", TINY, "--max-steps", "5", config_dir=config)
    assert run.rc != 0 and not read_metrics(run.out)
    assert "scheduler.params.total_num_steps: 30 in the DeepSpeed JSON but max_steps gives 5" in run.log.read_text()


def test_accelerate_launch_with_zero3_and_hf_auto_values(launch, generated, variant):
    """The DeepSpeed JSON says "auto" for everything HF Trainer fills in, the schedule's length too (so --max-steps
    may change it); the run trains the same way."""
    recipe = variant("tiny-auto", deepspeed={"auto_values": True})
    config = generated(recipe, "--zero", "3")
    assert json.loads((config / "deepspeed.json").read_text())["train_batch_size"] == "auto"
    run = launch("acc-zero3-auto", "accelerate", recipe, "--max-steps", str(STEPS), config_dir=config)
    records = assert_trained(run, zero=3)
    peak = max(r["learning_rate"] for r in records)
    assert peak == pytest.approx(0.005, rel=0.05)  # HF filled the recipe's learning rate into the scheduler


def test_torchrun_through_the_generated_launch_script_honours_edits_the_plan_allows(launch, tmp_path):
    """launch.sh trains plan.json's plan (here ZeRO-1, an override of `dmt generate`) with the files beside it, as
    they are on disk: a trainer argument and a DeepSpeed bucket size the plan does not set, edited by hand, are used."""
    from toolkit.cli.main import main

    config = tmp_path / "gen"
    assert main(["generate", str(TINY), "--out", str(config), "--zero", "1"]) == 0
    trainer_args = json.loads((config / "trainer_args.json").read_text())
    (config / "trainer_args.json").write_text(json.dumps({**trainer_args, "logging_steps": 5}))
    deepspeed = json.loads((config / "deepspeed.json").read_text())
    deepspeed["zero_optimization"]["reduce_bucket_size"] = 20_000_000
    (config / "deepspeed.json").write_text(json.dumps(deepspeed))
    run = launch("torchrun-launch-sh", "launch.sh", TINY, "torchrun", config_dir=config)
    assert [r["step"] for r in read_metrics(run.out)] == [5, 10, 15, 20, 25, 30], run.tail()
    latest = resolve_latest(run.out)
    assert latest.name == f"checkpoint-{RECIPE_STEPS}" and read_manifest(latest)["layout"]["zero"] == 1
    assert verify(latest).ok and run.rc == 0, run.tail()


def test_resume_of_a_different_run_is_refused(launch, wandb_recipe, variant):
    done = deepspeed_run(launch, wandb_recipe, 1)
    changed = variant("tiny-batch32", training={"global_batch": 32})
    before = read_metrics(done.out)
    run = launch("ds-refused-resume", "deepspeed", changed, "--zero", "1", "--max-steps", str(STEPS + 5),
                 "--output-dir", str(done.out), "--resume")
    assert run.rc != 0
    assert "belongs to a different run (global_batch: 16 -> 32)" in run.log.read_text()
    assert read_metrics(done.out) == before  # nothing was trained or appended


def test_fine_tuning_starts_from_pretrained_weights_on_disk(launch, wandb_recipe, variant):
    """A checkpoint of the ZeRO-1 run (HF weights, config and tokenizer) as `model.pretrained`: training starts
    where that run ended, far below a random init's loss."""
    trained = deepspeed_run(launch, wandb_recipe, 1)
    weights = str(resolve_latest(trained.out))
    recipe = variant("tiny-finetune", replace={"model": {"source": weights, "pretrained": weights}},
                     data={"tokenizer": {"path": weights}})
    run = launch("ds-finetune", "deepspeed", recipe, "--zero", "1", "--max-steps", "4")
    records = read_metrics(run.out)
    assert [r["step"] for r in records] == [1, 2, 3, 4], run.tail()
    random_init = read_metrics(trained.out)[0]["loss"]
    assert records[0]["loss"] < random_init - 1.5, (records[0]["loss"], random_init)
    assert verify(resolve_latest(run.out)).ok and run.rc == 0


def _train_py(recipe, output_dir) -> subprocess.CompletedProcess:
    """train.py as one process that believes it is one of 2 ranks: enough to reach the checks made before training."""
    return subprocess.run([*PYTHON_TRAIN, "--recipe", str(recipe), "--output-dir", str(output_dir)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, WORLD_SIZE="2"))


def test_bad_recipe_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("max_steps: 30", "max_steps: 30\n  max_stepz: 3"))
    result = _train_py(bad, tmp_path / "run")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: bad.yaml: training.max_stepz: unknown key; valid keys here:"), last


def test_fp16_on_cpu_is_refused_before_training(variant, tmp_path):
    """fp16 on CPU ranks: say so in one line instead of failing inside the engine or Accelerate (DeepSpeed's CPU
    accelerator refuses it on most hosts; on one with AVX-512 FP16 it accepts it, and Accelerate's grad scaler then
    needs a GPU)."""
    result = _train_py(variant("tiny-fp16", plan={"precision": "fp16"}), tmp_path / "run")
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "plan.precision: fp16" in last and ("cpu accelerator" in last or "needs a GPU" in last), last


def _edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


GENERATED_EDITS = {
    "changed-recipe": (lambda gen, recipe: recipe.write_text(recipe.read_text().replace("learning_rate: 0.005",
                                                                                         "learning_rate: 0.001")),
                       "plan.json: the recipe changed since `dmt generate` wrote it (training.learning_rate: 0.005 -> "
                       "0.001); run `dmt generate` again"),
    "edited-plan-json": (lambda gen, recipe: _edit_json(gen / "plan.json", lambda d: d["plan"].update(zero=3)),
                         "plan.json: plan.zero is 3 but the recipe gives 2; run `dmt generate` again"),
    "edited-deepspeed-json": (lambda gen, recipe: _edit_json(
        gen / "deepspeed.json", lambda d: d["zero_optimization"].update(stage=1)),
        "deepspeed.json: zero_optimization.stage is 1 but plan.json says zero 2"),
    "edited-trainer-args": (lambda gen, recipe: _edit_json(
        gen / "trainer_args.json", lambda d: d.update(per_device_train_batch_size=8)),
        "trainer_args.json: per_device_train_batch_size is 8 but plan.json says micro_batch 4"),
}


@pytest.mark.parametrize("edit", list(GENERATED_EDITS))
def test_a_generated_directory_that_no_longer_matches_is_refused_with_one_line(variant, tmp_path, edit):
    """train.py --plan refuses before launching anything when the recipe changed since `dmt generate` or a file
    changes the plan, naming the file and the key."""
    from toolkit.cli.main import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(variant("tiny-generated").read_text())
    gen = tmp_path / "gen"
    assert main(["generate", str(recipe), "--out", str(gen)]) == 0
    change, message = GENERATED_EDITS[edit]
    change(gen, recipe)
    result = subprocess.run([*PYTHON_TRAIN, "--plan", str(gen / "plan.json"), "--output-dir",
                             str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, WORLD_SIZE="2"))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"train.py: error: {gen}") and message in lines[0], lines
    assert not (tmp_path / "run").exists()
