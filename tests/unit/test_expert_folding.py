"""Megatron-Core's parallel folding as a plan rule: the expert layers' mesh ETP x EP x EDP x PP laid over the same
ranks as attention's TP x CP x DP x PP (megatron/core/parallel_state.py initialize_model_parallel, 0.16.1). The
plan resolves what Megatron-Core accepts, refuses what it refuses in one line naming the option, and the generated
megatron.yaml / megatron_args.txt carry the expert mesh to Megatron-Core's TransformerConfig and Megatron-LM's
parser."""

import pytest
import yaml

from helpers import ROOT
from megatron_lm_args import problems as megatron_lm_problems
from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.spec.model import ModelSpec, load_model_spec
from toolkit.spec.moe_rules import smallest_world
from toolkit.spec.plan import resolve_plan
from toolkit.validate.generated import read_generated
from toolkit.validate.megatron import validate_megatron_config

TINY_MEGATRON = ROOT / "recipes" / "tiny-llama-megatron-cpu.yaml"
# a tiny Qwen3-MoE: 4 experts, top-2, every layer MoE (what helper moe-runtime trains folded on 2 CPU ranks)
TINY_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64, intermediate_size=176,
                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=128,
                tie_word_embeddings=False, hidden_act="silu", bos_token_id=0, eos_token_id=0)
QWEN3_30B = load_model_spec("qwen3-30b-a3b")  # 128 experts, 4 kv heads
MIXTRAL = load_model_spec("mixtral-8x7b")


def _tiny_moe() -> ModelSpec:
    from toolkit.spec.model import spec_from_hf_dict

    return spec_from_hf_dict(TINY_MOE, "tiny-moe")


def test_ep_folds_over_tp_on_two_ranks():
    """EP 2 x ETP 1 over the same 2 ranks as TP 2: Megatron-Core builds both meshes (2 % (1 x 2 x 1) == 0), though
    EP 2 does not divide DP x CP = 1 (the rule this replaces)."""
    plan = resolve_plan(_tiny_moe(), 2, backend="megatron", tp=2, ep=2, etp=1, sequence_parallel=True)
    assert (plan.dp, plan.cp, plan.ep, plan.expert_tp, plan.expert_dp) == (1, 1, 2, 1, 1)
    assert smallest_world(plan.tp, plan.cp, plan.pp, plan.ep, plan.expert_tp) == 2


def test_etp_defaults_to_tp_and_equal_is_stored_unset():
    plan = resolve_plan(QWEN3_30B, 16, backend="megatron", tp=2, ep=8, sequence_parallel=True)
    assert plan.etp is None and plan.expert_tp == 2 and plan.expert_dp == 1
    assert resolve_plan(QWEN3_30B, 16, backend="megatron", tp=2, ep=8, etp=2, sequence_parallel=True).etp is None
    folded = resolve_plan(QWEN3_30B, 16, backend="megatron", tp=4, ep=16, etp=1, sequence_parallel=True)  # EP 16 > DP x CP = 4
    assert (folded.dp, folded.expert_tp, folded.expert_dp) == (4, 1, 1)
    assert smallest_world(8, 2, 4, 64, 1) == 4 * 64  # PP x max(TP x CP, EP x ETP) for powers of two
    assert smallest_world(8, 1, 2, 4, 1) == 2 * 8


@pytest.mark.parametrize("model, gpus, options, key, says", [
    (None, 2, dict(tp=2, ep=2), "--ep", "ep x etp x pp = 2 x 2 x 1 must divide the 2 GPUs"),
    (None, 2, dict(tp=2, ep=2), "--ep", "valid --etp at ep 2: 1 (--etp defaults to --tp)"),
    (None, 4, dict(tp=2, ep=2, etp=4), "--etp", "ep x etp x pp = 2 x 4 x 1 must divide the 4 GPUs"),
    (None, 2, dict(tp=2, ep=3), "--ep", "3 must divide the 4 experts"),
    (QWEN3_30B, 24, dict(tp=4, ep=16, etp=1), "--etp", "valid --ep at etp 1: 1, 2, 4, 8"),
    (load_model_spec("llama-3.1-8b"), 8, dict(tp=2, etp=1), "--etp", "expert tensor parallelism needs an MoE model"),
    (QWEN3_30B, 512, dict(tp=1, etp=512), "--etp", "512 must divide the experts' inner size 768"),
    (QWEN3_30B, 8, dict(backend="deepspeed", ep=16), "--ep", "16 must divide dp x cp = 8"),  # HF backends: EP in DP
    (QWEN3_30B, 8, dict(backend="deepspeed", etp=2), "--etp", "Megatron"),
])
def test_each_refusal_names_its_option(model, gpus, options, key, says):
    options = {"backend": "megatron", "sequence_parallel": options.get("tp", 1) > 1, **options}
    with pytest.raises(UserInputError) as info:
        resolve_plan(model or _tiny_moe(), gpus, **options)
    assert info.value.key == key and says in info.value.message and "\n" not in info.value.message, info.value


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    """Megatron-Core's MoELayer.forward raises in training with TP > 1 and no sequence parallelism; with it, the local
    spec (toolkit.compat.megatron_seams' sequence-parallel torch norms) folds EP 2 over TP 2 on 2 ranks."""
    with pytest.raises(UserInputError) as info:
        resolve_plan(_tiny_moe(), 2, backend="megatron", tp=2, ep=2, etp=1, transformer_impl="local")
    assert info.value.key == "--sequence-parallel" and "add --sequence-parallel" in info.value.message
    folded = resolve_plan(_tiny_moe(), 2, backend="megatron", tp=2, ep=2, etp=1, sequence_parallel=True,
                          transformer_impl="local")
    assert (folded.tp, folded.ep, folded.expert_tp, folded.dp, folded.expert_dp) == (2, 2, 1, 1, 1)
    assert resolve_plan(_tiny_moe(), 2, backend="megatron", ep=2, transformer_impl="local").expert_dp == 1


def test_biased_experts_train_at_etp_1_only():
    biased = _tiny_moe().model_copy(update={"mlp_bias": True, "name": "biased"})
    assert resolve_plan(biased, 2, backend="megatron", tp=2, ep=2, etp=1, sequence_parallel=True).expert_tp == 1
    with pytest.raises(UserInputError, match="biased experts"):
        resolve_plan(biased, 4, backend="megatron", tp=2, ep=2, sequence_parallel=True)


def _recipe(tmp_path, plan: dict, gpus: int = 2) -> str:
    recipe = yaml.safe_load(TINY_MEGATRON.read_text())
    recipe["model"] = {"config": TINY_MOE}
    recipe["plan"].update(plan)
    recipe["cluster"].update(gpus=gpus, gpus_per_node=gpus, accelerator="gpu")  # TP with MoE needs TE's norms
    recipe["plan"]["precision"] = "bf16"
    recipe["data"]["train_files"] = [str(TINY_MEGATRON.parent / f) for f in recipe["data"]["train_files"]]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_folded_plan_generates_and_validates(tmp_path):
    """dmt generate writes the expert mesh; Megatron-Core's TransformerConfig (validate_megatron_config builds it) and
    the table of Megatron-LM's parser accept it; dmt validate reads it back against plan.json."""
    recipe = _recipe(tmp_path, dict(tp=2, ep=2, etp=1, sequence_parallel=True))
    out = tmp_path / "out"
    assert main(["generate", recipe, "--out", str(out)]) == 0
    config = yaml.safe_load((out / "megatron.yaml").read_text())
    tc = config["transformer_config"]
    assert (tc["tensor_model_parallel_size"], tc["expert_model_parallel_size"], tc["expert_tensor_parallel_size"]) == (
        2, 2, 1)
    assert validate_megatron_config(config, 2) == []
    args = (out / "megatron_args.txt").read_text()
    assert "--expert-model-parallel-size 2" in args.splitlines()
    assert "--expert-tensor-parallel-size 1" in args.splitlines()
    assert megatron_lm_problems(args) == []
    assert main(["validate", str(out / "megatron.yaml"), "--world-size", "2"]) == 0
    run = read_generated(out)  # what train.py --plan reads: megatron.yaml agrees with plan.json
    assert (run.plan.ep, run.plan.etp, run.plan.expert_tp) == (2, 1, 1)


def test_validate_refuses_an_expert_mesh_megatron_core_cannot_build(tmp_path):
    recipe = _recipe(tmp_path, dict(tp=2, ep=2, etp=1, sequence_parallel=True))
    out = tmp_path / "out"
    assert main(["generate", recipe, "--out", str(out)]) == 0
    config = yaml.safe_load((out / "megatron.yaml").read_text())
    config["transformer_config"]["expert_tensor_parallel_size"] = 2
    problems = validate_megatron_config(config, 2)
    assert [p.key for p in problems] == ["transformer_config.expert_model_parallel_size"], problems
    assert "must divide the 2 GPUs" in problems[0].message and "valid --etp at ep 2: 1" in problems[0].message


def test_unfolded_moe_files_state_the_expert_mesh_and_dense_files_do_not(tmp_path):
    plan = resolve_plan(MIXTRAL, 16, backend="megatron", tp=2, ep=8, sequence_parallel=True)
    from toolkit.generate.megatron import _parallel

    assert _parallel(plan, MIXTRAL)["expert_tensor_parallel_size"] == 2
    dense = load_model_spec("llama-3.1-8b")
    assert "expert_tensor_parallel_size" not in _parallel(resolve_plan(dense, 8, backend="megatron"), dense)


def test_mtp_layers_reach_megatron_yaml_and_megatron_lm_flags(tmp_path):
    """A model with multi-token prediction modules (DeepSeek-V3: num_nextn_predict_layers 1) gets mtp_num_layers /
    --mtp-num-layers, which Megatron-Core's TransformerConfig and Megatron-LM's parser accept; validate reads it back
    into the model its plan rules check (a layout placing another number of MTP layers is refused)."""
    from toolkit.generate.megatron import megatron_config
    from toolkit.generate.megatron_args import megatron_args_text
    from toolkit.planner.recipe import recipe_plan
    from toolkit.spec.recipe import load_recipe, recipe_hf_config, recipe_model

    recipe = load_recipe(_recipe(tmp_path, dict(ep=2)))
    model = recipe_model(recipe).model_copy(update={"mtp_layers": 1})
    plan = recipe_plan(recipe, model)
    config = megatron_config(recipe, model, plan, recipe_hf_config(recipe))
    assert config["transformer_config"]["mtp_num_layers"] == 1
    assert validate_megatron_config(config, 2) == []
    args = megatron_args_text(config, "mtp")
    assert "--mtp-num-layers 1" in args.splitlines() and megatron_lm_problems(args) == []
    # read back: a layout must place the one MTP layer (or none); two are refused, naming the layout flag
    config["transformer_config"].update(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tmmL")
    problems = validate_megatron_config(config, 2)
    assert any("places 2 MTP layers (m); the model has 1" in p.message for p in problems), problems
    # a model without them writes neither
    plain = megatron_config(recipe, recipe_model(recipe), recipe_plan(recipe, recipe_model(recipe)),
                            recipe_hf_config(recipe))
    assert "mtp_num_layers" not in plain["transformer_config"]
