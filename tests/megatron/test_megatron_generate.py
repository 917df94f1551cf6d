"""`dmt generate` for Megatron plans: megatron.yaml and megatron_args.txt carry the resolved plan's numbers, the
committed megatron_configs/ match the code and validate, every Megatron-LM flag exists, and train.py validates its
--tp/--pp/--cp overrides before launching anything."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from megatron_helpers import TINY_MEGATRON, TINY_MOE

from helpers import ROOT
from megatron_lm_args import problems as megatron_lm_problems
from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.generate.megatron_examples import EXAMPLES, OUT, render_examples
from toolkit.validate.megatron import validate_megatron_config


def test_committed_examples_match_the_code():
    rendered = render_examples()
    assert {p.name for p in OUT.iterdir() if p.is_file()} == set(rendered)
    for name, text in rendered.items():
        assert (OUT / name).read_text() == text, f"{name} drifted: run python -m toolkit.generate.megatron_examples"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_validates_at_its_own_world_size(name):
    config = yaml.safe_load((OUT / f"{name}.yaml").read_text())
    assert validate_megatron_config(config, config["schedule"]["world_size"]) == []


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_megatron_args_parse_as_megatron_lm_parses_them(name):
    """Every flag known to Megatron-LM's parser at core_v0.16.1, each value of its type and among its choices (the
    real parse_args and validate_args accept every example, the folded MoE ones, the pipeline layout and DeepSeek-V3's
    multi-latent attention included:
    record_megatron_lm_flags.py --check, run at core_v0.16.1 on 2026-12-02)."""
    text = (OUT / f"{name}.args.txt").read_text()
    assert [line for line in text.splitlines() if line.startswith("--")]
    assert megatron_lm_problems(text) == []


def test_the_table_refuses_what_megatron_lm_refuses():
    assert megatron_lm_problems("--rotary-base 500000.0") == ["--rotary-base 500000.0: not int"]
    assert megatron_lm_problems("--bf16 true\n--no-such-flag 1\n--fp8-format e5m2") == [
        "--bf16: a switch, given ['true']", "--no-such-flag: not a flag of Megatron-LM's parser",
        "--fp8-format e5m2: not str{e4m3,hybrid}"]


def test_the_args_say_what_the_yaml_says():
    args = (OUT / "llama-3.1-70b-tp8-pp4-vpp5.args.txt").read_text().splitlines()
    for flag in ("--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 4",
                 "--num-virtual-stages-per-pipeline-rank 5", "--sequence-parallel", "--use-distributed-optimizer",
                 "--recompute-granularity selective", "--global-batch-size 512", "--micro-batch-size 1",
                 "--group-query-attention", "--num-query-groups 8", "--swiglu", "--use-rope-scaling",
                 "--rope-scaling-factor 8.0", "--transformer-impl transformer_engine"):
        assert flag in args, flag
    fp8 = (OUT / "llama-3.1-8b-tp2-cp2-fp8.args.txt").read_text().splitlines()
    assert "--fp8-format hybrid" in fp8 and "--context-parallel-size 2" in fp8 and "--bf16" in fp8
    assert "--fp8-recipe delayed" in fp8 and "--fp8-param-gather" not in fp8  # Megatron-Core's default recipe, stated
    bridge = (OUT / "llama-3.1-70b-tp4-pp8-vpp5-fp8.args.txt").read_text().splitlines()
    for flag in ("--fp8-format hybrid", "--fp8-recipe tensorwise", "--fp8-param-gather", "--use-distributed-optimizer",
                 "--num-virtual-stages-per-pipeline-rank 5"):
        assert flag in bridge, flag


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    def run(*flags: str) -> Path:
        out = tmp_path_factory.mktemp("megatron-generate")
        assert main(["generate", str(TINY_MEGATRON), "--out", str(out), *flags]) == 0
        return out

    return run


def test_dmt_generate_writes_the_megatron_files_of_the_resolved_plan(generated):
    import json

    from toolkit.outputs import RECORD  # what dmt generate wrote, to tell its files from the user's

    out = generated("--pp", "2")
    assert {p.name for p in out.iterdir()} == {"plan.json", "megatron.yaml", "megatron_args.txt", "launch.sh", RECORD,
                                              "slurm.sbatch", "ft_config.yaml"}
    plan = json.loads((out / "plan.json").read_text())["plan"]
    config = yaml.safe_load((out / "megatron.yaml").read_text())
    tc, schedule = config["transformer_config"], config["schedule"]
    assert (tc["tensor_model_parallel_size"], tc["pipeline_model_parallel_size"]) == (plan["tp"], plan["pp"]) == (1, 2)
    assert (schedule["data_parallel_size"], schedule["micro_batch_size"], schedule["num_microbatches"],
            schedule["global_batch_size"]) == (plan["dp"], plan["micro_batch"], plan["grad_accum"], plan["global_batch"])
    assert config["ddp_config"]["use_distributed_optimizer"] is plan["distributed_optimizer"]
    assert (tc["bf16"], tc["params_dtype"], tc.get("recompute_granularity")) == (False, "float32", None)
    assert tc["transformer_impl"] == "local" and tc["use_cpu_initialization"] is True  # a CPU recipe
    assert "--pipeline-model-parallel-size 2" in (out / "megatron_args.txt").read_text().splitlines()


def test_generate_refuses_a_family_without_a_mapping(tmp_path, capsys):
    recipe = yaml.safe_load(TINY_MEGATRON.read_text())
    recipe["model"] = {"source": "gemma-2-9b"}
    recipe["data"]["train_files"] = [str(TINY_MEGATRON.parent / f) for f in recipe["data"]["train_files"]]
    recipe["cluster"].update(gpus=8, gpus_per_node=8)
    recipe["training"].update(seq_len=4096, global_batch=32)
    path = tmp_path / "gemma.yaml"
    path.write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert main(["generate", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Megatron-Core mapping for model family 'gemma2'" in err[0], err


FOLDED = ("--tp", "2", "--ep", "2", "--etp", "1", "--sequence-parallel")


@pytest.mark.parametrize("flags", [("--ep", "2"), FOLDED], ids=["ep2", "folded"])
def test_a_tiny_deepseek_v3_generates_what_megatron_lm_and_megatron_core_accept(tmp_path, flags):
    """Multi-latent attention through `dmt generate`: megatron.yaml keeps MLATransformerConfig's fields, the validator
    and the training backend build that class from it, and megatron_args.txt says the same in Megatron-LM's own MLA
    flags (record_megatron_lm_flags.py --check on both files at core_v0.16.1, 2026-12-02: parse_args, validate_args
    and core_transformer_config_from_args, which built MLATransformerConfig)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from toolkit.backends.megatron.build import transformer_config

    recipe = yaml.safe_load(TINY_MEGATRON.read_text())
    recipe["model"] = {"config": TINY_MOE["deepseek_v3"]}
    recipe["data"]["train_files"] = [str(TINY_MEGATRON.parent / f) for f in recipe["data"]["train_files"]]
    (tmp_path / "ds.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["generate", str(tmp_path / "ds.yaml"), "--out", str(tmp_path / "out"), *flags]) == 0
    config = yaml.safe_load((tmp_path / "out" / "megatron.yaml").read_text())
    text = (tmp_path / "out" / "megatron_args.txt").read_text()
    assert validate_megatron_config(config, 2) == [] and megatron_lm_problems(text) == []
    tc = transformer_config(config)
    assert type(tc) is MLATransformerConfig and tc.multi_latent_attention and tc.q_lora_rank is None
    assert (tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim, tc.rope_type) == (32, 16, 16, 16,
                                                                                                      "rope")
    args = text.splitlines()
    for flag in ("--multi-latent-attention", "--kv-lora-rank 32", "--qk-head-dim 16", "--qk-pos-emb-head-dim 16",
                 "--v-head-dim 16", "--rope-type rope", "--no-rope-fusion", "--moe-layer-freq 1",
                 "--moe-shared-expert-intermediate-size 32", "--moe-router-score-function sigmoid",
                 "--moe-router-enable-expert-bias", "--moe-router-dtype fp32", "--mtp-num-layers 1",
                 "--expert-model-parallel-size 2", "--qk-layernorm"):
        assert flag in args, flag
    # q_lora_rank null: Megatron-LM's own default (queries projected directly); every head its own keys and values
    assert not [a for a in args if a.startswith(("--q-lora-rank", "--group-query-attention", "--num-query-groups"))]


def test_deepseek_v3_says_its_dense_layers_and_yarn_in_megatron_lm_flags():
    """The committed DeepSeek-V3 example: 3 dense layers then 58 MoE ones as the list pattern Megatron-LM's
    moe_freq_type evaluates (its characters only; the header turns globbing off), and YaRN's factor and mscales."""
    config = yaml.safe_load((OUT / "deepseek-v3-tp2-pp16-ep64-etp1.yaml").read_text())
    text = (OUT / "deepseek-v3-tp2-pp16-ep64-etp1.args.txt").read_text()
    args = text.splitlines()
    for flag in ("--multi-latent-attention", "--q-lora-rank 1536", "--kv-lora-rank 512", "--qk-head-dim 128",
                 "--qk-pos-emb-head-dim 64", "--v-head-dim 128", "--rope-type yarn", "--rotary-scaling-factor 40.0",
                 "--mscale 1.0", "--mscale-all-dim 1.0", "--moe-router-num-groups 8", "--moe-router-group-topk 4",
                 "--moe-router-topk-scaling-factor 2.5", "--mtp-num-layers 1", "--expert-tensor-parallel-size 1"):
        assert flag in args, flag
    assert "--no-rope-fusion" not in args  # MLATransformerConfig fuses YaRN
    (pattern,) = [a.split(" ", 1)[1] for a in args if a.startswith("--moe-layer-freq ")]
    assert pattern == "[0]*3+[1]*58" and set(pattern) <= set("0123456789,[]()+*")  # Megatron-LM's _eval_pattern's
    assert eval(pattern, {"__builtins__": {}}) == config["transformer_config"]["moe_layer_freq"]
    assert args[1].startswith("# Usage: set -f; torchrun")


def test_kimi_k2_yarn_betas_megatron_lm_cannot_say_are_refused_in_one_line(tmp_path, capsys):
    """Kimi K2's YaRN beta_fast (1, not 32): megatron.yaml could hold it, but Megatron-LM has no flag and would train
    with MLATransformerConfig's 32; dmt generate exits 2 in one line naming the key, and writes nothing."""
    recipe = yaml.safe_load((ROOT / "recipes" / "mixtral-8x7b-megatron.yaml").read_text())
    recipe["model"] = {"source": "kimi-k2"}
    recipe["data"] = {"blend": [{"prefix": "/data/web", "weight": 1.0}],
                      "tokenizer": {"path": "moonshotai/Kimi-K2-Instruct"}}
    recipe["cluster"]["gpus"], recipe["training"]["global_batch"] = 1024, 4096
    recipe["plan"].update(tp=2, pp=16, ep=64, etp=1, first_stage_layers=1, last_stage_layers=4, recompute="full")
    (tmp_path / "kimi.yaml").write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "kimi.yaml"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "transformer_config.beta_fast: 1.0" in err[0] and "Megatron-LM" in err[0], err
    assert not (tmp_path / "out").exists()


def test_generate_refuses_attention_sinks_in_one_line():
    """gpt_oss is mapped for `dmt convert`; dmt generate writes no Megatron-LM flags for its sinks, windows and YaRN."""
    import json

    from toolkit.families import megatron_fields
    from toolkit.generate.megatron import check_generatable
    from toolkit.spec.model import PRESET_DIR

    for preset in ("gpt-oss-20b", "gpt-oss-120b"):
        with pytest.raises(UserInputError) as err:
            check_generatable(megatron_fields(json.loads((PRESET_DIR / f"{preset}.json").read_text())))
        assert err.value.key == "model.source" and "dmt convert" in err.value.message and "\n" not in str(err.value)
    check_generatable(megatron_fields(json.loads((PRESET_DIR / "deepseek-v3.json").read_text())))  # MLA generates


def _train_py(*flags: str) -> subprocess.CompletedProcess:
    """train.py as one process that believes it is one of 2 ranks: enough to reach the checks made before training."""
    return subprocess.run([sys.executable, "-m", "toolkit.train", "--recipe", str(TINY_MEGATRON), *flags],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, WORLD_SIZE="2", HF_HUB_OFFLINE="1"))


@pytest.mark.parametrize("flags, says", [
    (("--tp", "4"), "train.py: error: --tp: 4 must divide attention heads (4) and kv heads (2)"),
    (("--cp", "2"), "train.py: error: --cp: context parallelism needs Transformer Engine layer modules"),
    (("--zero", "1"), "train.py: error: --zero: is a DeepSpeed option; with Megatron use --distributed-optimizer"),
    (("--precision", "fp8"), "train.py: error: --precision: fp8 runs CUDA kernels (Transformer Engine's, torchao's); CPU ranks"),
])
def test_train_py_validates_plan_overrides_before_launching(flags, says, tmp_path):
    result = _train_py(*flags, "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(says), result.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing was started


@pytest.mark.parametrize("plan, fields, flags", [
    ({"recompute": "selective", "recompute_modules": ["mlp"]},
     {"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, ["--recompute-modules mlp"]),
    ({"recompute": "full", "recompute_num_layers": 1},
     {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
     ["--recompute-granularity full", "--recompute-method block", "--recompute-num-layers 1"]),
], ids=["selective-mlp", "full-block"])
def test_partial_recompute_of_the_recipe_reaches_megatron_yaml_and_args(tmp_path, plan, fields, flags):
    recipe = yaml.safe_load(TINY_MEGATRON.read_text())
    recipe["plan"].update(plan)
    recipe["data"]["train_files"] = [str(TINY_MEGATRON.parent / f) for f in recipe["data"]["train_files"]]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["generate", str(path), "--out", str(tmp_path / "out")]) == 0
    config = yaml.safe_load((tmp_path / "out" / "megatron.yaml").read_text())
    assert {k: config["transformer_config"].get(k) for k in fields} == fields
    args = (tmp_path / "out" / "megatron_args.txt").read_text().splitlines()
    assert set(flags) <= set(args)
    assert megatron_lm_problems("\n".join(args)) == []
    assert validate_megatron_config(config, config["schedule"]["world_size"]) == []


def test_train_refuses_a_megatron_yaml_that_contradicts_plan_json(tmp_path):
    """A hand edit of megatron.yaml that changes the plan stops train.py --plan before launching, naming the file."""
    import os
    import subprocess
    import sys

    from toolkit.cli.main import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TINY_MEGATRON.read_text().replace("data/", f"{TINY_MEGATRON.parent}/data/"))
    out = tmp_path / "gen"
    assert main(["generate", str(recipe), "--out", str(out), "--tp", "2"]) == 0
    config = yaml.safe_load((out / "megatron.yaml").read_text())
    for section in ("ddp_config", "optimizer_config"):  # valid for Megatron-Core, but not the plan
        config[section]["use_distributed_optimizer"] = True
    (out / "megatron.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "toolkit.train", "--plan", str(out / "plan.json")],
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, WORLD_SIZE="2"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0] == (f"train.py: error: {out / 'megatron.yaml'}: ddp_config.use_distributed_optimizer is True but "
                        f"plan.json says distributed_optimizer False; run `dmt generate` again, or edit only what the "
                        f"plan does not set")


def test_every_mapped_moe_preset_has_a_folded_example():
    """Each MoE preset Megatron-Core can build has a committed example with its experts folded (ETP != TP or EP beyond
    DP x CP), so the tests above run Megatron-LM's parser table and Megatron-Core's TransformerConfig on it."""
    from toolkit.families import MAPPED
    from toolkit.spec.model import load_model_spec, preset_names

    # Kimi K2's YaRN betas have no Megatron-LM flag: refused (test_kimi_k2_yarn_betas_megatron_lm_cannot_say_...);
    # gpt_oss is mapped for dmt convert only (test_generate_refuses_attention_sinks_in_one_line)
    moe = {name for name in preset_names()
           if (spec := load_model_spec(name)).is_moe and spec.family in MAPPED and name != "kimi-k2"
           and spec.family != "gpt_oss"}
    folded = set()
    for name in EXAMPLES:
        config = yaml.safe_load((OUT / f"{name}.yaml").read_text())
        tc, schedule = config["transformer_config"], config["schedule"]
        expert_tp = tc.get("expert_tensor_parallel_size", tc["tensor_model_parallel_size"])
        data = schedule["data_parallel_size"] * tc["context_parallel_size"]
        if expert_tp != tc["tensor_model_parallel_size"] or tc["expert_model_parallel_size"] > data:
            folded.add(EXAMPLES[name].model or load_recipe_model(EXAMPLES[name].recipe))
    assert moe and moe <= folded, moe - folded


def load_recipe_model(recipe: str) -> str:
    from toolkit.spec.recipe import load_recipe

    return load_recipe(ROOT / "recipes" / recipe).model.source
