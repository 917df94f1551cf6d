"""Fine-tuning for real on 2 CPU ranks: LoRA on chat data under DeepSpeed ZeRO-2 and QLoRA (a 4-bit bitsandbytes base)
on prompt/completion data under ZeRO-3, each launched once and judged the way a user would: the loss on the answers
falls (also for LoRA on FSDP2, whose parameters are checked to be DTensor shards), the checkpoint's adapter holds
every module's tensors at the plan's rank with values moved from PEFT's init, PeftModel.from_pretrained puts it on
the base, `dmt convert merge-lora` equals PEFT's merge_and_unload(), and the guard's rollback reloads a LoRA run's
last adapter."""

import json
import tempfile
from pathlib import Path

import pytest

from helpers import ROOT
from toolkit.cli.main import main
from toolkit.runtime.metrics import read_metrics

pytestmark = pytest.mark.launch
LORA = ROOT / "recipes" / "tiny-llama-lora-cpu.yaml"
QLORA = ROOT / "recipes" / "tiny-llama-qlora-cpu.yaml"
STEPS = 16
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def lora(launch):
    return launch("lora-zero2", "deepspeed", LORA, "--max-steps", str(STEPS), "--save-steps", str(STEPS))


@pytest.fixture(scope="module")
def qlora(launch):
    return launch("qlora-zero3", "deepspeed", QLORA, "--max-steps", str(STEPS), "--save-steps", str(STEPS))


@pytest.fixture(scope="module")
def lora_fsdp(launch, generated):
    """The same LoRA recipe on FSDP2, through the generated launch.sh under torchrun."""
    out = generated(LORA, "--backend", "fsdp")
    return launch("lora-fsdp", "launch.sh", LORA, "torchrun", "--max-steps", str(STEPS), "--save-steps", str(STEPS),
                  config_dir=out)


def _checkpoint(run):
    checkpoint = run.out / f"checkpoint-{STEPS}"
    assert (checkpoint / "adapter_model.safetensors").is_file(), run.tail()
    return checkpoint


@pytest.mark.parametrize("which", ["lora", "qlora", "lora_fsdp"])
def test_the_loss_on_the_answers_falls(which, request):
    run = request.getfixturevalue(which)
    losses = [record["loss"] for record in read_metrics(run.out)]
    assert len(losses) == STEPS, run.tail()
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


@pytest.mark.parametrize("which", ["lora", "qlora", "lora_fsdp"])
def test_the_adapter_is_whole_and_trained(which, request):
    """Every targeted module of every layer has lora_A (r x in) and lora_B (out x r), none empty (ZeRO-3 saves
    partitions as size-0 tensors when nothing gathers them), and every lora_B moved away from PEFT's zero init: the
    gradient reached each adapter."""
    from safetensors.torch import load_file

    checkpoint = _checkpoint(request.getfixturevalue(which))
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and set(config["target_modules"]) == set(MODULES)
    tensors = load_file(checkpoint / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * len(MODULES)  # A and B, 2 layers
    hidden, ffn, kv = 64, 176, 32
    widths = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}
    for name, tensor in tensors.items():
        module = next(m for m in MODULES if f".{m}." in name)
        fan_in, fan_out = widths[module]
        assert tuple(tensor.shape) == ((8, fan_in) if "lora_A" in name else (fan_out, 8)), name
        if "lora_B" in name:
            assert tensor.abs().max() > 0, f"{name} is still PEFT's zero init"


def test_peft_loads_the_adapter_onto_the_base_and_merge_lora_equals_merge_and_unload(lora, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    checkpoint, base_dir = _checkpoint(lora), lora.out / "base"
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    tokens = torch.arange(1, 33)[None]
    base_logits = base(tokens).logits
    adapted = PeftModel.from_pretrained(base, checkpoint)
    with torch.no_grad():
        adapted_logits = adapted(tokens).logits
    assert not torch.allclose(adapted_logits, base_logits, atol=1e-3)
    reference = adapted.merge_and_unload().state_dict()
    assert main(["convert", "merge-lora", str(base_dir), str(checkpoint), str(tmp_path / "merged")]) == 0
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(merged) == set(reference)
    assert all(torch.equal(merged[name], reference[name]) for name in merged)  # fp32 base: bit for bit
    merged_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged_model(tokens).logits, adapted_logits, atol=1e-4, rtol=1e-4)


# PEFT merges into a 4-bit base by dequantising it, adding the delta and quantising again; `dmt convert merge-lora` adds
# the same delta to the weights the 4-bit base was quantised from. They differ by two nf4 roundings, the base's and
# PEFT's requantisation: on the tiny QLoRA run 0.13 to 0.31 of a weight's norm (nf4 alone rounds a random-init weight by
# 0.09 to 0.24 of its norm); the bound stated: 0.5, and never more than the two roundings together.
NF4_MERGE_TOLERANCE = 0.5


def test_merge_lora_of_a_qlora_adapter_is_within_two_nf4_roundings_of_peft_on_the_4bit_base(qlora, tmp_path):
    import torch
    from peft import PeftModel
    from peft.utils.integrations import dequantize_bnb_weight
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from toolkit.backends.peft_model import quantization_config
    from toolkit.spec.finetune import FinetuneOptions
    from toolkit.spec.model import load_model_spec
    from toolkit.spec.plan import resolve_plan

    checkpoint, base_dir = _checkpoint(qlora), qlora.out / "base"
    assert main(["convert", "merge-lora", str(base_dir), str(checkpoint), str(tmp_path / "merged")]) == 0
    ours, original = load_file(tmp_path / "merged" / "model.safetensors"), load_file(base_dir / "model.safetensors")
    plan = resolve_plan(load_model_spec(str(base_dir)), 2, zero=3, finetune=FinetuneOptions(method="qlora"))
    base = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quantization_config(plan),
                                                dtype=torch.bfloat16)

    def dequantised(model) -> dict:
        return {name: dequantize_bnb_weight(m.weight, state=m.weight.quant_state).float()
                for name, m in model.named_modules() if type(m).__name__ == "Linear4bit"}

    quantised_base = dequantised(base)
    peft_merged = dequantised(PeftModel.from_pretrained(base, checkpoint).merge_and_unload())
    assert len(peft_merged) == 14
    worst = 0.0
    for name, peft_weight in peft_merged.items():
        weight, before = ours[f"{name}.weight"].float(), original[f"{name}.weight"].float()
        norm = weight.norm()
        rounding = ((quantised_base[name] - before).norm()
                    + (peft_weight - (quantised_base[name] + weight - before)).norm()) / norm
        relative = (peft_weight - weight).norm() / norm
        assert relative <= rounding + 1e-4, name
        worst = max(worst, float(relative))
    assert worst <= NF4_MERGE_TOLERANCE, worst
    print(f"merge-lora vs PEFT's 4-bit merge: at most {worst:.3f} of a weight's norm apart")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                          checkpoint).merge_and_unload().state_dict()
    assert all(torch.equal(ours[name], reference[name]) for name in ours)  # the base as stored (fp32): bit for bit


def test_restore_test_of_a_qlora_run_resumes_bit_for_bit(tmp_path, capsys, monkeypatch):
    """Reference run, SIGKILL right after the save at step 3, resume: adapters, their optimizer states, the data order
    and the 4-bit base come back, steps 4-6 identical to the bit. Without --workdir the runs go to a temp dir of the
    command's own, removed once the test passed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the command's temp dir: this test's own
    code = main(["restore-test", "--recipe", str(QLORA), "--steps", "6", "--save-at", "3", "--json"])
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert code == 0 and result["identical"], result["mismatches"]
    assert Path(result["checkpoint"]).is_relative_to(tmp_path) and not list(tmp_path.glob("dmt-restore-*"))
    assert "dmt-restore" not in captured.err


def test_fsdp_shards_the_adapters_and_holds_what_the_estimate_says(lora_fsdp):
    """sharding.json (what each rank held after its first step) against the memory model: the adapters' fp32 shards,
    their gradients and AdamW's two moments, each 1/2 of the adapters per rank."""
    from toolkit.estimate.memory import estimate_memory
    from toolkit.planner.recipe import recipe_plan
    from toolkit.spec.recipe import load_recipe, recipe_model

    recipe = load_recipe(LORA)
    model = recipe_model(recipe)
    plan = recipe_plan(recipe, model, backend="fsdp")
    predicted = estimate_memory(model, plan)
    ranks = json.loads((lora_fsdp.out / "sharding.json").read_text())["ranks"]
    for rank in ranks:
        assert rank["sharded"] == rank["parameters"] == 28  # every adapter matrix is a DTensor shard
        assert rank["gradient_bytes"] == predicted.gradients
        assert rank["optimizer_bytes"] >= predicted.optimizer  # + AdamW's 0-dim step tensors
        assert rank["optimizer_bytes"] - predicted.optimizer <= 8 * 28


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_the_guard_rolls_a_lora_run_back_to_its_last_adapter(backend, launch, generated, variant):
    """A loss spike at step 4 under on_nan/spike rollback: the adapter saved after the rollback is the one of
    checkpoint-2, and the run goes on to the end. (The DeepSpeed checkpoint of a PEFT model holds the adapters only,
    so it is reloaded non-strictly, as HF's own resume does; FSDP2 reloads through HF's PEFT-aware resume.)"""
    import torch
    from safetensors.torch import load_file

    from toolkit.runtime.incident import read_incidents

    guard = {"on_nan": "rollback", "spike_factor": 3, "window": 2}
    path = variant("lora-rollback", base=LORA, training={"max_steps": 6, "save_steps": 2, "guard": guard})
    fault = {"DMT_FAULT": "spike=50@step=4"}
    if backend == "deepspeed":
        run = launch("lora-rollback", "deepspeed", path, env=fault)
    else:
        config = generated(path, "--backend", "fsdp")
        run = launch("lora-rollback-fsdp", "launch.sh", path, "torchrun", config_dir=config, env=fault)
        assert (run.out / "sharding.json").is_file(), run.tail()  # trained sharded (what each rank held, checked)
    assert run.rc == 0, run.tail()
    [event] = read_incidents(run.out)
    assert (event["step"], event["action"], event["checkpoint"], event["dropped_steps"]) == \
           (4, "rollback", "checkpoint-2", [3, 4]), event
    restored, after, last = (load_file(run.out / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (2, 4, 6))
    assert len(restored) == 2 * len(MODULES) * 2 and all(restored[k].numel() for k in restored)
    assert restored.keys() == after.keys() and all(torch.equal(restored[k], after[k]) for k in restored)
    assert not all(torch.equal(restored[k], last[k]) for k in restored)  # and it trained on after the rollback
    assert [r["step"] for r in read_metrics(run.out)] == list(range(1, 7))
