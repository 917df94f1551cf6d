"""Recipes: a typed schema that names bad keys; `dmt generate` writes files that agree with the plan and with each
other, that the libraries' own config readers accept, and that `dmt validate` passes; committed examples never drift."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, TINY
from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.generate.examples import EXAMPLES, OUT, example_context, render_examples
from toolkit.spec.recipe import load_recipe

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
SCHEDULES = {"WarmupCosineLR": "cosine_with_min_lr", "WarmupDecayLR": "linear", "WarmupLR": "constant_with_warmup"}


def _generate(recipe: Path, out: Path, *flags: str) -> dict:
    assert main(["generate", str(recipe), "--out", str(out), *flags]) == 0
    return json.loads((out / "plan.json").read_text())


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_generates_files_that_agree(recipe, tmp_path, capsys):
    out = tmp_path / "gen"
    record = _generate(recipe, out)
    plan = record["plan"]
    assert record["memory_bytes"]["total"] > 0 and isinstance(record["fits"], bool)
    if plan["backend"] == "megatron":  # Megatron recipes get their files from the Megatron writers, not these
        assert not (out / "deepspeed.json").exists() and not (out / "trainer_args.json").exists()
        return
    if plan["backend"] == "fsdp":  # accelerate.yaml and trainer_args.json, checked in tests/fsdp
        assert not (out / "deepspeed.json").exists() and (out / "trainer_args.json").exists()
        assert main(["validate", str(out / "accelerate.yaml"), "--world-size", str(plan["gpus"]),
                     "--trainer-args", str(out / "trainer_args.json")]) == 0, capsys.readouterr().err
        return
    ds = json.loads((out / "deepspeed.json").read_text())
    hf = json.loads((out / "trainer_args.json").read_text())
    accelerate = yaml.safe_load((out / "accelerate.yaml").read_text())
    training = load_recipe(recipe).training
    assert plan["global_batch"] == plan["micro_batch"] * plan["grad_accum"] * plan["dp"]
    # with Ulysses, HF's check counts every rank as data-parallel: Accelerate fills in micro x accumulation x dp
    assert ds["train_batch_size"] == ("auto" if plan.get("sp", 1) > 1 else plan["global_batch"])
    assert ds["train_micro_batch_size_per_gpu"] == hf["per_device_train_batch_size"] == plan["micro_batch"]
    assert ds["gradient_accumulation_steps"] == hf["gradient_accumulation_steps"] == plan["grad_accum"]
    assert ds["zero_optimization"]["stage"] == plan["zero"]
    assert ds["bf16"]["enabled"] == hf["bf16"] == (plan["precision"] == "bf16")
    assert ds["fp16"]["enabled"] == hf["fp16"] == (plan["precision"] == "fp16")
    assert ds["gradient_clipping"] == hf["max_grad_norm"] == training.grad_clip
    assert ds["optimizer"]["type"] == "AdamW" and hf["optim"] == "adamw_torch"
    assert ds["optimizer"]["params"]["lr"] == hf["learning_rate"] == training.learning_rate
    assert hf["lr_scheduler_type"] == SCHEDULES[ds["scheduler"]["type"]]
    assert ds["scheduler"]["params"]["total_num_steps"] == hf["max_steps"] == training.max_steps
    assert ds["scheduler"]["params"]["warmup_num_steps"] == max(1, hf["warmup_steps"])
    assert hf["activation_checkpointing"] == (plan["recompute"] == "full")
    assert hf["deepspeed"] == str(out / "deepspeed.json")
    assert accelerate["num_processes"] == plan["gpus"] and "mixed_precision" not in accelerate
    assert accelerate["deepspeed_config"]["deepspeed_config_file"] == str(out / "deepspeed.json")
    assert (out / "launch.sh").stat().st_mode & 0o111
    assert subprocess.run(["bash", "-n", str(out / "launch.sh")]).returncode == 0
    capsys.readouterr()
    assert main(["validate", str(out / "deepspeed.json"), "--world-size", str(plan["gpus"]),
                 "--trainer-args", str(out / "trainer_args.json")]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("recipe", [p for p in RECIPES if "megatron" not in p.stem], ids=lambda p: p.stem)
def test_generated_files_load_in_the_libraries_own_config_classes(recipe, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from transformers import TrainingArguments

    out = tmp_path / "gen"
    plan = _generate(recipe, out)["plan"]
    cluster = load_config_from_file(str(out / "accelerate.yaml"))
    assert cluster.num_processes == plan["gpus"]
    assert cluster.distributed_type == ("FSDP" if plan["backend"] == "fsdp" else "DEEPSPEED")
    hf = json.loads((out / "trainer_args.json").read_text())
    hf.pop("deepspeed", None)  # constructing with it would start DeepSpeed's distributed setup
    hf.update(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False)  # this machine has no GPU
    args = TrainingArguments(**hf)
    assert args.per_device_train_batch_size == plan["micro_batch"]


def test_plan_auto_is_the_planners_choice(tmp_path):
    from toolkit.planner.search import best_plan
    from toolkit.spec.cluster import get_gpu
    from toolkit.spec.recipe import recipe_model

    recipe_path = ROOT / "recipes/llama-3.1-70b-64xh100.yaml"
    record = _generate(recipe_path, tmp_path / "gen")
    recipe = load_recipe(recipe_path)
    chosen = best_plan(recipe_model(recipe), 64, get_gpu("h100-80gb"), seq_len=8192, global_batch=512,
                       gpus_per_node=8, backend="deepspeed")
    assert record["auto"] is True and record["fits"] is True
    assert record["plan"] == chosen.as_dict()


def test_plan_auto_shorthand_is_accepted(tmp_path):
    text = (ROOT / "recipes/llama-3.1-70b-64xh100.yaml").read_text()
    short = tmp_path / "auto.yaml"
    short.write_text(text.replace("plan:\n  auto: true\n  backend: deepspeed", "plan: auto"))
    assert "plan: auto\n" in short.read_text()
    plan = load_recipe(short).plan
    assert plan.auto is True and plan.backend is None  # every backend is searched


def test_overrides_reach_the_launch_script_and_multi_node_needs_a_rendezvous(tmp_path):
    """The override is part of the plan plan.json records, which every launcher of launch.sh trains."""
    out = tmp_path / "gen"
    _generate(ROOT / "recipes/llama-3.1-70b-64xh100.yaml", out, "--micro-batch", "1")
    script = (out / "launch.sh").read_text()
    record = json.loads((out / "plan.json").read_text())
    assert record["plan"]["micro_batch"] == 1 and record["overrides"] == {"micro_batch": 1}
    assert '--plan "$HERE/plan.json"' in script and "--no_ssh" in script and "--node_rank" in script
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    result = subprocess.run(["bash", str(out / "launch.sh"), "torchrun"], capture_output=True, text=True, env=env)
    assert result.returncode != 0 and "set NODE_RANK" in result.stderr


def test_generate_into_an_existing_directory_keeps_other_files(tmp_path):
    out = tmp_path / "gen"
    (out / "run").mkdir(parents=True)
    (out / "run" / "metrics.jsonl").write_text("{}\n")
    _generate(TINY, out)
    assert (out / "run" / "metrics.jsonl").read_text() == "{}\n"
    assert {p.name for p in out.iterdir()} >= {"deepspeed.json", "accelerate.yaml", "trainer_args.json", "launch.sh",
                                               "plan.json", "run"}
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_failed_generate_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gen"
    assert main(["generate", str(TINY), "--out", str(out), "--tp", "3"]) == 2
    assert "--tp: 3 must divide attention heads" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_unknown_recipe_key_names_the_dotted_key_and_the_valid_ones(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("  zero: 2", "  zeroo: 2").replace("data/", str(TINY.parent / "data") + "/"))
    with pytest.raises(UserInputError) as caught:
        load_recipe(bad)
    assert caught.value.key == "bad.yaml: plan.zeroo"
    assert "valid keys here: auto, backend, tp," in caught.value.message


def test_a_bad_plan_in_a_recipe_is_named_by_its_recipe_key_and_a_bad_flag_by_the_flag(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("global_batch: 16", "global_batch: 15")
                   .replace("data/", str(TINY.parent / "data") + "/"))
    assert main(["generate", str(bad), "--out", str(tmp_path / "gen")]) == 2
    assert capsys.readouterr().err.strip() == ("dmt generate: error: training.global_batch: 15 is not divisible by "
                                               "micro-batch x dp = 4 x 2; try 16")
    bad.write_text(TINY.read_text().replace("precision: bf16", "precision: fp8"))
    assert main(["generate", str(bad), "--out", str(tmp_path / "gen")]) == 2
    assert capsys.readouterr().err.strip().startswith("dmt generate: error: plan.precision: fp8 runs CUDA kernels")
    assert main(["generate", str(TINY), "--out", str(tmp_path / "gen"), "--zero", "0", "--offload-optimizer",
                 "cpu"]) == 2
    assert capsys.readouterr().err.strip().startswith("dmt generate: error: --offload-optimizer: optimizer offload "
                                                      "needs --zero 1, 2 or 3")


def test_a_recipe_that_is_not_yaml_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [oops\nmodel: {}\n")
    assert main(["generate", str(bad), "--out", str(tmp_path / "gen")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"dmt generate: error: --recipe: {bad} is not valid YAML"), err


def test_zero_plus_plus_on_one_node_is_refused_with_the_fix(tmp_path, capsys):
    recipe = tmp_path / "zeropp.yaml"
    recipe.write_text(TINY.read_text() + "deepspeed:\n  zero_plus_plus: true\n")
    assert main(["generate", str(recipe), "--out", str(tmp_path / "gen"), "--zero", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "deepspeed.zero_plus_plus: ZeRO++ applies to ZeRO-3 across nodes" in err


def test_hf_auto_values_are_written_only_when_asked(tmp_path, capsys):
    recipe = tmp_path / "auto.yaml"
    recipe.write_text(TINY.read_text().replace("data/", str(TINY.parent / "data") + "/") +
                      "deepspeed:\n  auto_values: true\n")
    out = tmp_path / "gen"
    _generate(recipe, out)
    ds = json.loads((out / "deepspeed.json").read_text())
    assert ds["train_batch_size"] == ds["optimizer"]["params"]["lr"] == ds["bf16"]["enabled"] == "auto"
    assert ds["zero_optimization"]["stage"] == 2  # the layout itself stays explicit
    for extra in ([], ["--trainer-args", str(out / "trainer_args.json")]):
        capsys.readouterr()
        assert main(["validate", str(out / "deepspeed.json"), "--world-size", "2", *extra]) == 0, capsys.readouterr()


def test_committed_deepspeed_examples_have_not_drifted():
    rendered = render_examples()
    assert {p.name for p in OUT.glob("*.json")} == set(rendered)
    for name, text in rendered.items():
        assert (OUT / name).read_text() == text, f"{name} drifted: run python -m toolkit.generate.examples"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_committed_examples_pass_the_validator(name, capsys):
    example = EXAMPLES[name]
    recipe, plan = example_context(example)
    code = main(["validate", str(OUT / name), "--world-size", str(plan.gpus), "--model", example.model,
                 "--seq-len", str(plan.seq_len), "--recompute", plan.recompute, "--json"])
    report = json.loads(capsys.readouterr().out)
    # every example is structurally valid; only the memory estimate may object (ZeRO-0 holds all of 8B's states)
    assert all(p["key"] == "memory" for p in report["problems"]), report
    assert report["ok"] == example.fits and code == (0 if example.fits else 2)


def test_verbs_help_imports_no_heavy_library():
    code = ("import sys; from toolkit.cli.main import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['validate', '--help']):\n"
            "    assert main(argv) == 0\n"
            "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'accelerate') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_pre_training_from_a_hub_id_reads_its_config_from_the_hub_cache(tmp_path):
    """model.source may be a hub id: the config to instantiate comes through AutoConfig (here from a local hub cache,
    offline); an id that is not there is one UserInputError naming model.source."""
    cache, revision = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny-llama"
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512)))
    recipe = yaml.safe_load(TINY.read_text())
    recipe["model"] = {"source": "acme/tiny-llama"}
    recipe["data"]["train_files"] = [str(TINY.parent / f) for f in recipe["data"]["train_files"]]
    path = tmp_path / "hub.yaml"
    path.write_text(yaml.safe_dump(recipe))
    script = ("import sys; from toolkit.spec.recipe import load_recipe, recipe_model; "
              "from toolkit.spec.recipe import recipe_hf_config; from toolkit.errors import UserInputError\n"
              "r = load_recipe(sys.argv[1]); c = recipe_hf_config(r); print(c['model_type'], c['hidden_size'])\n"
              "r = r.model_copy(update={'model': r.model.model_copy(update={'source': 'acme/absent'})})\n"
              "try:\n    recipe_hf_config(r)\nexcept UserInputError as exc:\n    print(exc.key)\n")
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120)
    assert result.stdout.split() == ["llama", "64", "model.source"], result.stderr[-2000:]


HOSTILE = "we ird 'q' \"dq\" $(touch PWNED) `touch PWNED` ;touch PWNED #h 50% ü"


def test_launch_script_keeps_hostile_paths_whole_and_runs_nothing_in_them(tmp_path):
    """The recipe and the generated directory under a name full of shell syntax (quotes, $(), backticks, ;, #, %,
    non-ASCII): launch.sh hands each path to the launcher as one argument, and nothing in it runs. (A line break is
    refused: an #SBATCH line cannot carry one.)"""
    hostile = tmp_path / HOSTILE
    hostile.mkdir()
    recipe = hostile / "recipe.yaml"
    recipe.write_text(TINY.read_text().replace("data/tiny_corpus.txt", str(TINY.parent / "data/tiny_corpus.txt")))
    out = hostile / "gen"
    assert main(["generate", str(recipe), "--out", str(out)]) == 0
    fake = tmp_path / "bin"
    fake.mkdir()
    for launcher in ("torchrun", "deepspeed", "accelerate"):  # each records the arguments it was given
        (fake / launcher).write_text(f"#!{sys.executable}\nimport json, sys\n"
                                     f"json.dump(sys.argv[1:], open({str(tmp_path / launcher)!r} + '.json', 'w'))\n")
        (fake / launcher).chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}")
    env.pop("RECIPE", None)
    env.pop("OUTPUT_DIR", None)
    for launcher in ("torchrun", "deepspeed", "accelerate"):
        result = subprocess.run(["bash", str(out / "launch.sh"), launcher, "--resume", "auto"], capture_output=True,
                                text=True, env=env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        argv = json.loads((tmp_path / f"{launcher}.json").read_text())
        tail = argv[argv.index("--recipe"):]
        assert tail == ["--recipe", str(recipe), "--plan", str(out / "plan.json"), "--output-dir", str(out / "run"),
                        "--resume", "auto", "--resume", "auto"], tail  # launch.sh's own, then the one given
    assert not list(tmp_path.rglob("PWNED"))
    broken = tmp_path / "line\nbreak"
    assert main(["generate", str(recipe), "--out", str(broken)]) == 2
    assert not broken.exists()


@pytest.mark.parametrize("name", ["tiny\ntouch PWNED", "../../escape", "with space", "ünïcode", "-starts-with-dash",
                                  "x" * 101])
def test_a_recipe_name_that_is_not_a_safe_run_name_is_refused(tmp_path, capsys, name):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TINY.read_text().replace("name: tiny-llama-cpu", f"name: {json.dumps(name)}"))
    assert main(["generate", str(recipe), "--out", str(tmp_path / "gen")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "recipe.yaml: name:" in err and "letters, digits" in err, err
    assert not (tmp_path / "gen").exists()
