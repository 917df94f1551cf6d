"""plan.attention flash_attention_2 as a user meets it without a GPU: the HF backends take it (Ulysses too), the
rules refuse it where the libraries would (Megatron-Core's own attention, torch context parallelism, fp32), memory
counts no s x s matrix for it, and toolkit/train.py refuses it on CPU ranks in one line before building anything."""

import pytest

from toolkit.errors import UserInputError
from toolkit.estimate.memory import estimate_memory
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

LLAMA_8B = load_model_spec("llama-3.1-8b")
FLASH = "flash_attention_2"


@pytest.mark.parametrize("options", [dict(), dict(backend="fsdp"), dict(sp=2), dict(zero=3, recompute="full")])
def test_the_hf_backends_take_flash_attention(options):
    assert resolve_plan(LLAMA_8B, 8, attention=FLASH, **options).attention == FLASH


@pytest.mark.parametrize("options, says", [
    (dict(backend="megatron"), "--transformer-impl"),
    (dict(backend="fsdp", cp=2), "sdpa only, not flash_attention_2"),
    (dict(precision="fp32"), "bf16 or fp16 only"),
])
def test_flash_attention_is_refused_where_the_libraries_refuse_it(options, says):
    with pytest.raises(UserInputError) as caught:
        resolve_plan(LLAMA_8B, 8, attention=FLASH, **options)
    assert caught.value.key == "--attention" and says in caught.value.message


def test_ulysses_still_refuses_eager_and_names_the_kernels_it_runs():
    with pytest.raises(UserInputError) as caught:
        resolve_plan(LLAMA_8B, 8, sp=2, attention="eager")
    assert caught.value.message == ("Ulysses (--sp) runs sdpa or flash_attention_2; eager needs the whole 4D mask")


def test_flash_attention_keeps_what_sdpa_keeps_and_no_s_squared_term():
    memory = {a: estimate_memory(LLAMA_8B, resolve_plan(LLAMA_8B, 8, seq_len=8192, attention=a)).activations
              for a in ("sdpa", "eager", FLASH)}
    assert memory[FLASH] == memory["sdpa"] < memory["eager"]


def test_train_py_refuses_flash_attention_on_cpu_ranks_in_one_line(tmp_path, capsys):
    from helpers import ROOT
    from toolkit.train import main

    code = main(["--recipe", str(ROOT / "recipes" / "tiny-llama-cpu.yaml"), "--attention", FLASH, "--output-dir",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0] == ("train.py: error: plan.attention: flash_attention_2 needs CUDA (flash-attn is a CUDA extension) "
                      "and these ranks train on the CPU; valid on CPU ranks: sdpa, eager")
    assert not (tmp_path / "run").exists()  # refused before anything was written
