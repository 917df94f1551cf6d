"""`dmt generate` for an fsdp plan: accelerate.yaml and trainer_args.json state the same FSDP2 plugin (Accelerate's
loader and the Trainer's own plugin construction read them), launch.sh and slurm.sbatch launch it, train.py --plan
refuses an edit that changes the plan, and every fsdp plan `dmt plan` ranks generates files that validate."""

import json
import subprocess

import pytest
import yaml
from fsdp_helpers import TINY_FSDP

from helpers import ROOT, TINY
from toolkit.cli.main import main
from toolkit.errors import UserInputError

SFT_8B = ROOT / "recipes" / "llama-3.1-8b-sft-8xh100.yaml"


def test_accelerate_yaml_and_trainer_args_state_the_same_plugin(fsdp_generated, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    plan = json.loads((fsdp_generated / "plan.json").read_text())["plan"]
    cluster = load_config_from_file(str(fsdp_generated / "accelerate.yaml"))
    assert cluster.distributed_type == "FSDP" and cluster.num_processes == plan["gpus"] == 2
    assert cluster.mixed_precision == "bf16" and cluster.use_cpu is True
    fsdp = cluster.fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"  # the model's _no_split_modules
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)  # the Trainer's arguments set it
    hf = json.loads((fsdp_generated / "trainer_args.json").read_text())
    args = TrainingArguments(**hf)
    assert args.bf16 and not args.activation_checkpointing and "deepspeed" not in hf
    assert args.per_device_train_batch_size == plan["micro_batch"]
    assert args.gradient_accumulation_steps == plan["grad_accum"]
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)  # what the Trainer hands to its Accelerator
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is fsdp["fsdp_reshard_after_forward"]
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type) and not plugin.activation_checkpointing
    assert hf["accelerator_config"]["gradient_accumulation_kwargs"]["sync_each_batch"] is True


def test_launch_script_offers_accelerate_and_torchrun(fsdp_generated):
    script = (fsdp_generated / "launch.sh").read_text()
    assert subprocess.run(["bash", "-n", str(fsdp_generated / "launch.sh")]).returncode == 0
    assert 'LAUNCHER="${1:-accelerate}"' in script and "exec torchrun --max-restarts" in script
    assert "--nproc_per_node 2" in script
    assert 'accelerate launch --config_file "$HERE/accelerate.yaml"' in script and "deepspeed --num_gpus" not in script


def test_slurm_render_runs_and_converts_fsdp_recipes(fsdp_generated, capsys):
    capsys.readouterr()
    assert main(["slurm", "render", str(TINY_FSDP), "--launcher", "accelerate", "--accelerate-config",
                 str(fsdp_generated / "accelerate.yaml")]) == 0
    assert "accelerate launch --config_file" in capsys.readouterr().out
    assert main(["slurm", "render", str(TINY_FSDP), "--convert"]) == 0
    assert 'dmt convert fsdp-to-hf "$LATEST"' in capsys.readouterr().out
    assert main(["slurm", "render", str(TINY_FSDP), "--launcher", "deepspeed"]) == 2
    assert "runs under torchrun or accelerate" in capsys.readouterr().err


def test_backend_on_the_command_line_leaves_out_the_recipes_deepspeed_options(tmp_path):
    """tiny-llama-cpu.yaml says `zero: 2`; with --backend fsdp that option is DeepSpeed's and not carried over."""
    from toolkit.validate.generated import read_generated

    assert main(["generate", str(TINY), "--out", str(tmp_path / "gen"), "--backend", "fsdp"]) == 0
    record = json.loads((tmp_path / "gen" / "plan.json").read_text())
    assert record["plan"]["backend"] == "fsdp" and record["plan"]["zero"] == 0 and record["plan"]["dp_shard"] == 2
    assert record["overrides"] == {"backend": "fsdp"}
    run = read_generated(tmp_path / "gen" / "plan.json")  # train.py --plan accepts it
    assert run.plan.backend == "fsdp" and run.accelerate["distributed_type"] == "FSDP"


def test_train_refuses_an_accelerate_yaml_that_contradicts_the_plan(tmp_path):
    from toolkit.validate.generated import read_generated

    assert main(["generate", str(TINY_FSDP), "--out", str(tmp_path / "gen")]) == 0
    path = tmp_path / "gen" / "accelerate.yaml"
    config = yaml.safe_load(path.read_text())
    config["fsdp_config"]["fsdp_reshard_after_forward"] = False
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(UserInputError) as caught:  # the trainer arguments still say true: the files disagree first
        read_generated(tmp_path / "gen" / "plan.json")
    assert caught.value.key == str(path) and "reshard_after_forward" in caught.value.message
    trainer = json.loads((tmp_path / "gen" / "trainer_args.json").read_text())
    trainer["fsdp_config"]["reshard_after_forward"] = False
    (tmp_path / "gen" / "trainer_args.json").write_text(json.dumps(trainer))
    with pytest.raises(UserInputError) as caught:  # both agree now, but not with plan.json
        read_generated(tmp_path / "gen" / "plan.json")
    assert "but plan.json says reshard_after_forward True" in caught.value.message


def test_an_accelerate_yaml_of_the_other_backend_is_refused_at_launch(monkeypatch):
    from toolkit.backends.hf_inputs import check_launch
    from toolkit.spec.model import load_model_spec
    from toolkit.spec.plan import resolve_plan

    plan = resolve_plan(load_model_spec("llama-3.2-1b"), 2, backend="fsdp")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UserInputError, match="a deepspeed accelerate.yaml but the plan trains with fsdp"):
        check_launch(plan)


def test_every_ranked_fsdp_plan_generates_files_that_validate(tmp_path, capsys):
    capsys.readouterr()
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "64",
                 "--backends", "fsdp", "--top", "4", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["plans"]
    assert len(ranked) == 4 and {r["plan"]["backend"] for r in ranked} == {"fsdp"}
    recipe = yaml.safe_load(SFT_8B.read_text())
    recipe["cluster"].update(gpus=16)
    recipe["base_dir"] = str(SFT_8B.parent)
    for index, record in enumerate(ranked):
        plan = record["plan"]
        recipe["training"].update(seq_len=plan["seq_len"], global_batch=plan["global_batch"])
        path = tmp_path / f"recipe{index}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        options = {k: plan[k] for k in ("backend", "tp", "dp_shard", "dp_replicate", "micro_batch", "recompute",
                                        "offload_params")}
        flags = [f for k, v in options.items() for f in (f"--{k.replace('_', '-')}", str(v))]
        flags += [] if plan["reshard_after_forward"] else ["--no-reshard-after-forward"]
        out = tmp_path / f"gen{index}"
        assert main(["generate", str(path), "--out", str(out), *flags]) == 0
        assert json.loads((out / "plan.json").read_text())["plan"] == plan
        assert main(["validate", str(out / "accelerate.yaml"), "--world-size", "16", "--trainer-args",
                     str(out / "trainer_args.json")]) == 0, capsys.readouterr().err
