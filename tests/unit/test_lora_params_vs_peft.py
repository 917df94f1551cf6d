"""The trainable count `dmt estimate` reports for LoRA equals, to the parameter, what real PEFT reports for the model."""

import random

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from test_params_vs_transformers import FAMILIES, _random_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from toolkit.errors import UserInputError  # noqa: E402
from toolkit.estimate.lora import trainable_params  # noqa: E402
from toolkit.families.linears import LINEARS, MOE  # noqa: E402
from toolkit.spec.finetune import FinetuneOptions  # noqa: E402
from toolkit.spec.model import spec_from_hf_dict  # noqa: E402


def _targets(family: str, rng: random.Random) -> tuple[str, ...]:
    """all-linear, or a random subset of the family's modules by their last name (PEFT's usual spelling)."""
    if rng.random() < 0.3 and family not in MOE:
        return ("all-linear",)
    names = sorted({linear.name.rsplit(".", 1)[-1] for linear in LINEARS[family] if linear.where != "model"})
    return tuple(rng.sample(names, rng.randint(1, len(names))))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_trainable_count_is_what_peft_reports(family, seed):
    rng = random.Random(f"lora-{family}-{seed}")
    config = _random_config(family, rng)
    finetune = FinetuneOptions(method="lora", r=rng.choice([1, 4, 8]), target_modules=_targets(family, rng))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=finetune.r, lora_alpha=finetune.alpha, target_modules=list(finetune.target_modules)
                           if finetune.target_modules != ("all-linear",) else "all-linear")
    trainable, _ = peft.get_peft_model(model, lora).get_nb_trainable_parameters()
    spec = spec_from_hf_dict(config.to_dict(), f"{family}-{seed}", filled=True)
    assert trainable_params(spec, finetune) == trainable


def test_a_target_that_names_no_module_is_one_line():
    config = _random_config("llama", random.Random(0))
    spec = spec_from_hf_dict(config.to_dict(), "llama", filled=True)
    with pytest.raises(UserInputError, match="--lora-target-modules: 'qkv_proj' names no linear module of llama"):
        trainable_params(spec, FinetuneOptions(method="lora", target_modules=("qkv_proj",)))
    moe = spec_from_hf_dict(_random_config("mixtral", random.Random(0)).to_dict(), "mixtral", filled=True)
    with pytest.raises(UserInputError, match="all-linear on mixtral: PEFT also adapts the routed experts"):
        trainable_params(moe, FinetuneOptions(method="lora"))
