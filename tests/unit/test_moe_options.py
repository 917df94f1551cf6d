"""The MoE plan options (spec/options.py: dispatcher, grouped GEMM, capacity factor, load balancing, the MoE recompute
modules, the routing imbalance): their rules as Megatron-Core 0.16.1's TransformerConfig and token dispatchers take
them, the defaults a resolved plan states, and what megatron.yaml / megatron_args.txt carry to Megatron-Core and
Megatron-LM's parser."""

import json

import pytest
import yaml
from test_expert_folding import TINY_MOE, _recipe, _tiny_moe

from megatron_lm_args import problems as megatron_lm_problems
from toolkit.cli.main import main
from toolkit.errors import UserInputError
from toolkit.spec.model import load_model_spec
from toolkit.spec.moe_rules import MOE_OPTIONS
from toolkit.spec.options import MOE_IMBALANCE_DEFAULT, RECOMPUTE_MODULES, flag
from toolkit.spec.plan import resolve_plan
from toolkit.validate.megatron import validate_megatron_config

LLAMA = load_model_spec("llama-3.1-8b")
QWEN3_30B = load_model_spec("qwen3-30b-a3b")
DEEPSEEK_V3 = load_model_spec("deepseek-v3")
VALUES = {"moe_dispatcher": "alltoall", "moe_grouped_gemm": True, "moe_capacity_factor": 1.25,
          "moe_load_balancing": "aux_loss"}


@pytest.mark.parametrize("name", MOE_OPTIONS)
def test_an_moe_option_on_a_dense_model_is_refused_by_its_flag(name):
    with pytest.raises(UserInputError) as info:
        resolve_plan(LLAMA, 8, backend="megatron", **{name: VALUES[name]})
    assert info.value.key == flag(name) and "has no experts" in info.value.message


def test_a_resolved_moe_plan_states_megatron_cores_usual_choices():
    qwen = resolve_plan(QWEN3_30B, 16, backend="megatron", ep=8)
    assert (qwen.moe_dispatcher, qwen.moe_grouped_gemm, qwen.moe_load_balancing, qwen.moe_capacity_factor) == (
        "alltoall", True, "aux_loss", None)
    cpu = resolve_plan(_tiny_moe(), 2, backend="megatron", transformer_impl="local")
    assert (cpu.moe_dispatcher, cpu.moe_grouped_gemm) == ("allgather", False)
    deepseek = resolve_plan(DEEPSEEK_V3, 128, backend="megatron", ep=64, first_stage_layers=1, last_stage_layers=None,
                            pp=2)
    assert deepseek.moe_load_balancing == "expert_bias"  # its router's e_score_correction_bias
    dense = resolve_plan(LLAMA, 8, backend="megatron")
    assert (dense.moe_dispatcher, dense.moe_grouped_gemm, dense.moe_load_balancing) == (None, None, None)
    assert qwen.moe_imbalance == MOE_IMBALANCE_DEFAULT == 1.23  # FEPLB's 18.6% wait: 1 / (1 - 0.186)


@pytest.mark.parametrize("model, options, key, says", [
    (None, dict(moe_dispatcher="flex", transformer_impl="local"), "--moe-dispatcher", "DeepEP's CUDA kernels"),
    (None, dict(moe_dispatcher="flex"), "--moe-dispatcher", "flex needs ep x etp > 1"),
    (None, dict(moe_grouped_gemm=True, transformer_impl="local"), "--moe-grouped-gemm", "GroupedLinear"),
    (None, dict(moe_capacity_factor=0.0), "--moe-capacity-factor", "positive multiple"),
    (QWEN3_30B, dict(moe_load_balancing="expert_bias"), "--moe-load-balancing", "needs a sigmoid router"),
    (None, dict(recompute="selective", recompute_modules="moe_act", moe_grouped_gemm=False), "--recompute-modules",
     "moe_act is recomputed with grouped GEMM only"),
    (QWEN3_30B, dict(recompute="selective", recompute_modules="mla_up_proj"), "--recompute-modules",
     "needs multi-latent attention"),
    (QWEN3_30B, dict(recompute="selective", recompute_modules="shared_experts"), "--recompute-modules",
     "no shared experts"),
    (LLAMA, dict(recompute="selective", recompute_modules="moe"), "--recompute-modules", "has no experts"),
    (QWEN3_30B, dict(recompute="selective", recompute_modules="moe_act", precision="fp8"), "--recompute-modules",
     "delayed scaling"),
    (None, dict(moe_imbalance=0.5), "--moe-imbalance", "between 1.0 (balanced)"),
])
def test_each_moe_refusal_names_its_option(model, options, key, says):
    with pytest.raises(UserInputError) as info:
        resolve_plan(model or _tiny_moe(), 8 if model is None else 16, backend="megatron", **options)
    assert info.value.key == key and says in info.value.message and "\n" not in info.value.message, info.value


def test_every_recompute_module_of_megatron_core_is_an_option():
    """TransformerConfig 0.16.1's allowed_modules, all of them (the MoE ones extend core_attn and mlp)."""
    assert set(RECOMPUTE_MODULES) == {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                                      "shared_experts"}
    plan = resolve_plan(DEEPSEEK_V3, 128, backend="megatron", ep=64, pp=2, first_stage_layers=1,
                        recompute="selective", recompute_modules="mla_up_proj,moe_act,layernorm,shared_experts")
    assert plan.recompute_modules == ("moe_act", "layernorm", "mla_up_proj", "shared_experts")


def test_moe_options_reach_megatron_core_and_megatron_lm(tmp_path):
    """A dropping, grouped-GEMM, all-to-all plan with the MoE recompute modules: TransformerConfig builds from the
    generated megatron.yaml and Megatron-LM's parser table takes every flag."""
    recipe = _recipe(tmp_path, dict(ep=2, moe_capacity_factor=1.25, recompute="selective",
                                    recompute_modules=["moe_act", "moe", "layernorm"]))
    out = tmp_path / "out"
    assert main(["generate", recipe, "--out", str(out)]) == 0
    config = yaml.safe_load((out / "megatron.yaml").read_text())
    tc = config["transformer_config"]
    assert (tc["moe_token_dispatcher_type"], tc["moe_grouped_gemm"], tc["moe_expert_capacity_factor"],
            tc["recompute_modules"], tc["moe_router_load_balancing_type"]) == (
        "alltoall", True, 1.25, ["moe_act", "moe", "layernorm"], "aux_loss")
    assert validate_megatron_config(config, 2) == []
    args = (out / "megatron_args.txt").read_text()
    assert {"--moe-expert-capacity-factor 1.25", "--moe-token-dispatcher-type alltoall", "--moe-grouped-gemm",
            "--recompute-modules moe_act moe layernorm"} <= set(args.splitlines())
    assert megatron_lm_problems(args) == []
    config["transformer_config"]["moe_grouped_gemm"] = False  # moe_act without grouped GEMM: one line naming it
    problems = validate_megatron_config(config, 2)
    assert [p.key for p in problems] == ["transformer_config.recompute_modules"], problems


def test_explain_states_the_routing_imbalance_and_its_source(capsys):
    assert main(["estimate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--backend", "megatron", "--ep", "8",
                 "--explain"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "MoE routing imbalance 1.23" in text and "arXiv:2604.19654" in text and "dropless" in text
    assert main(["estimate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--backend", "megatron", "--ep", "8",
                 "--moe-imbalance", "1.5", "--explain"]) == 0
    assert "MoE routing imbalance 1.5 (busiest expert rank's tokens / the mean; given by --moe-imbalance)" in " ".join(
        capsys.readouterr().out.split())


def test_tiny_moe_config_is_the_folding_tests_one():
    assert TINY_MOE["num_experts"] == _tiny_moe().num_experts == 4


GPT_OSS = load_model_spec("gpt-oss-20b")


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_attention_sinks_refuse_sdpa_and_default_to_eager_on_the_hf_backends(backend):
    """transformers' GptOss has no sdpa path (_supports_sdpa = False: a ValueError at load); the plan refuses it in one
    line naming --attention, resolves the default to eager, and the planner's search proposes no sdpa plan."""
    with pytest.raises(UserInputError) as info:
        resolve_plan(GPT_OSS, 8, backend=backend, attention="sdpa")
    assert info.value.key == "--attention" and "valid: eager, flash_attention_2" in info.value.message
    assert "\n" not in info.value.message
    assert resolve_plan(GPT_OSS, 8, backend=backend).attention == "eager"
    assert resolve_plan(GPT_OSS, 8, backend=backend, attention="flash_attention_2").attention == "flash_attention_2"
    assert resolve_plan(QWEN3_30B, 8, backend=backend).attention == "sdpa"  # no sinks: the usual default
    from toolkit.estimate.comm import Network
    from toolkit.planner.search import search
    from toolkit.spec.cluster import get_gpu

    gpu = get_gpu("h100-80gb")
    result = search(GPT_OSS, 16, gpu, Network.from_catalogue(gpu, 8), (backend,), seq_len=4096)
    assert result.ranked and {c.plan.attention for c in result.ranked} == {"eager"}


def test_transformers_gpt_oss_refuses_sdpa_and_builds_eager():
    """What the rule above mirrors, on transformers' own GptOss (a tiny config on the meta device)."""
    pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4,
                                  num_experts_per_tok=2, vocab_size=97, layer_types=["sliding_attention",
                                                                                     "full_attention"])
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def test_plan_offers_no_expert_parallelism_on_the_hf_backends_and_explain_says_why(capsys):
    """The HF backends train an MoE model's experts as ordinary sharded parameters: the search tries no --ep > 1 for
    them (so no plan of theirs is rejected for it), and `dmt plan --explain` says why in one line per backend."""
    argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--global-batch", "64", "--seq-len", "4096",
            "--top", "40", "--json"]
    for backends, ep in (("deepspeed,fsdp", lambda e: e == 1), ("megatron", lambda e: e > 1)):
        assert main(argv + ["--backends", backends]) == 0
        record = json.loads(capsys.readouterr().out)
        assert not any("--ep" in why for why in record["rejected"])
        assert any(ep(p["plan"]["ep"]) for p in record["plans"])
        assert backends == "megatron" or all(p["plan"]["ep"] == 1 for p in record["plans"])
    assert main(argv[:-1] + ["--backends", "deepspeed,fsdp,megatron", "--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for backend in ("deepspeed", "fsdp"):
        said = [line for line in lines if line.startswith(f"{backend}: no expert parallelism searched: ")]
        assert len(said) == 1 and "--backend megatron" in said[0]
    assert not any(line.startswith("megatron: no expert parallelism") for line in lines)


@pytest.mark.parametrize("model, gpus, options, says", [
    (LLAMA, 8, dict(ep=1), "has no experts"),
    (None, 8, dict(ep=1), "needs expert parallelism"),
    (None, 8, dict(ep=2, moe_dispatcher="allgather"), "alltoall or flex, got allgather"),
    (None, 8, dict(ep=2, recompute="full"), "refuses full recomputation"),
    (None, 8, dict(ep=2, precision="fp32"), "bf16 or fp16 model"),
    (None, 8, dict(ep=2, pp=2), "needs an interleaved schedule"),
    (None, 8, dict(ep=2, transformer_impl="local", moe_grouped_gemm=False), "CUDA stream"),
    (DEEPSEEK_V3, 128, dict(ep=64), "with an MTP layer needs a pipeline"),
    (DEEPSEEK_V3.model_copy(update={"mtp_layers": 2}), 128, dict(ep=64, pp=2, vpp=2,
                                                                  pipeline_model_parallel_layout="Et*15|(t*15|)*2t*16mmL"),
     "at most one MTP layer"),
])
def test_each_overlap_refusal_is_megatron_cores_and_names_the_flag(model, gpus, options, says):
    """TransformerConfig.__post_init__'s overlap_moe_expert_parallel_comm asserts (Megatron-Core 0.16.1), each as one
    line naming --overlap-moe-expert-parallel-comm."""
    with pytest.raises(UserInputError) as info:
        resolve_plan(model or _tiny_moe(), gpus, backend="megatron", overlap_moe_expert_parallel_comm=True,
                     **options)
    assert info.value.key == "--overlap-moe-expert-parallel-comm", info.value
    assert says in info.value.message and "\n" not in info.value.message, info.value


def test_expert_overlap_reaches_megatron_core_and_megatron_lm(tmp_path):
    """The overlap is written where Megatron-Core's TransformerConfig (built by validate) and Megatron-LM's parser
    take it, read back into the plan, and refused by validate where the file breaks its rule."""
    recipe = _recipe(tmp_path, dict(ep=2, overlap_moe_expert_parallel_comm=True))
    out = tmp_path / "out"
    assert main(["generate", recipe, "--out", str(out)]) == 0
    config = yaml.safe_load((out / "megatron.yaml").read_text())
    assert config["transformer_config"]["overlap_moe_expert_parallel_comm"] is True
    assert validate_megatron_config(config, 2) == []
    args = (out / "megatron_args.txt").read_text()
    assert "--overlap-moe-expert-parallel-comm" in args.splitlines() and megatron_lm_problems(args) == []
    assert json.loads((out / "plan.json").read_text())["plan"]["overlap_moe_expert_parallel_comm"] is True
    config["transformer_config"]["moe_token_dispatcher_type"] = "allgather"
    problems = validate_megatron_config(config, 2)
    assert problems and problems[0].key == "transformer_config.overlap_moe_expert_parallel_comm", problems
    # without it nothing is written: the files of every other plan stay as they were
    plain = _recipe(tmp_path, dict(ep=2))
    assert main(["generate", plain, "--out", str(tmp_path / "plain")]) == 0
    assert "overlap_moe" not in (tmp_path / "plain" / "megatron.yaml").read_text()


def test_explain_names_the_overlap_the_flex_exchange_and_the_dispatchers_cost(capsys):
    assert main(["estimate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--backend", "megatron", "--ep", "16",
                 "--moe-dispatcher", "flex", "--overlap-moe-expert-parallel-comm", "--global-batch", "64",
                 "--explain"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "moe_overhead" in text and "2.36 ms of host-side dispatch per MoE layer forward" in text
    # 4 micro-batches: the first forward and the last backward run alone (combined_1f1b_schedule_for_no_pipelining)
    assert "hidden behind the paired micro-batch's compute in 75% of the passes" in text
    assert "flex: a token crosses the network once per remote domain" in text
