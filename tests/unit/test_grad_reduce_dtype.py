"""--grad-reduce-in-bf16: Megatron-Core's main-grad buffers in the parameters' dtype, as NeMo's and Megatron-Bridge's
performance recipes run (grad_reduce_in_fp32 = False), estimated, generated and validated."""

import pytest
import yaml

from helpers import ROOT
from megatron_lm_args import problems as megatron_lm_problems
from toolkit.cli.main import main
from toolkit.estimate.memory import CUDA_CONTEXT_BYTES, estimate_memory
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

# NVIDIA/dgxc-benchmarking v25.04, llama3.1/README.md: the layout of its Llama 3.1 8B runs on 8 H100 (TP 1, CP 2,
# DP 4, MBS 1, GBS 128, no recomputation; NeMo's llama3_8b recipe with performance_mode, which reduces gradients in
# bf16), and the sample log line of one of them (GBS 128, 12.39 s a step: the BF16 run's time, 12.27 s in its table,
# not FP8's 9.33), logged by MegatronStrategy with NEMO_LOG_MEMORY_USAGE=1 (torch.cuda.max_memory_reserved() and, after
# the step's forward and backward, torch.cuda.memory_allocated())
DGXC_8B = dict(backend="megatron", cp=2, micro_batch=1, global_batch=128, seq_len=8192, distributed_optimizer=True,
               recompute="none")
DGXC_8B_PEAK_RESERVED = 70833405952
DGXC_8B_ALLOCATED = 44271689728


def test_bf16_gradients_halve_the_gradient_buffers_and_nothing_else():
    model = load_model_spec("llama-3.1-8b")
    fp32, bf16 = (estimate_memory(model, resolve_plan(model, 8, grad_reduce_in_bf16=flag, **DGXC_8B))
                  for flag in (False, True))
    assert bf16.gradients * 2 == fp32.gradients
    assert (bf16.weights, bf16.optimizer, bf16.activations) == (fp32.weights, fp32.optimizer, fp32.activations)


def test_the_dgx_cloud_8b_run_holds_what_the_estimate_says():
    """Its model states are what stays allocated after the step's backward (bf16 weights, bf16 gradients, Adam's
    fp32 shards over dp x cp = 8); the estimate's peak, less the CUDA context the allocator does not see, is within 5%
    of what the run reserved. With fp32 gradients the estimate was 80.6 GiB, over the part."""
    model = load_model_spec("llama-3.1-8b")
    memory = estimate_memory(model, resolve_plan(model, 8, grad_reduce_in_bf16=True, **DGXC_8B))
    states = memory.weights + memory.gradients + memory.optimizer
    assert states == pytest.approx(DGXC_8B_ALLOCATED, rel=0.01)
    assert memory.total - CUDA_CONTEXT_BYTES == pytest.approx(DGXC_8B_PEAK_RESERVED, rel=0.05)


@pytest.mark.parametrize("flags, says", [
    (("--backend", "megatron", "--precision", "fp32"), "--grad-reduce-in-bf16: reduces bf16 gradients: it needs "
                                                       "--precision bf16, fp8 or fp4, not fp32"),
    (("--backend", "deepspeed",), "--grad-reduce-in-bf16"),
])
def test_the_option_is_refused_where_megatron_lm_ignores_it(capsys, flags, says):
    capsys.readouterr()
    code = main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--grad-reduce-in-bf16", *flags])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and says in lines[0], lines


@pytest.mark.parametrize("flag", [False, True])
def test_generated_files_say_which_dtype_and_validate(tmp_path, capsys, flag):
    """megatron.yaml's DistributedDataParallelConfig and Megatron-LM's flags (validate_args turns fp32 reduction on
    under --bf16 unless --grad-reduce-in-bf16) agree with the plan, and `dmt validate` reads the choice back."""
    recipe = yaml.safe_load((ROOT / "recipes" / "llama-3.1-70b-64xh100.yaml").read_text())
    recipe["plan"] = {"backend": "megatron", "tp": 8, "pp": 4, "distributed_optimizer": True,
                      "sequence_parallel": True, "grad_reduce_in_bf16": flag}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    assert main(["generate", str(path), "--out", str(out)]) == 0, capsys.readouterr().err
    assert main(["validate", str(out)]) == 0, capsys.readouterr().err
    ddp = yaml.safe_load((out / "megatron.yaml").read_text())["ddp_config"]
    args = (out / "megatron_args.txt").read_text()
    assert ddp["grad_reduce_in_fp32"] is not flag
    assert ("--grad-reduce-in-bf16" in args.splitlines()) is flag
    assert ("--accumulate-allreduce-grads-in-fp32" in args.splitlines()) is not flag
    assert megatron_lm_problems(args) == []
