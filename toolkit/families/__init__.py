"""The model families the toolkit reads, by HF model_type. Each family's module declares how its config.json reads
into a ModelSpec and, where it has one, its Megatron-Core mapping; family.py, mapping.py, lineage.py and
activations.py hold what the families share."""

from toolkit.errors import UserInputError
from toolkit.families import (
    deepseek_v3,
    gemma2,
    gpt2,
    gpt_neox,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    opt,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from toolkit.families.family import Family
from toolkit.families.mapping import MegatronMapping

FAMILIES: dict[str, Family] = {module.FAMILY.model_type: module.FAMILY for module in (
    llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, deepseek_v3, gpt_oss, gemma2, phi3, gpt2, gpt_neox, opt)}
# model_types whose config.json names another family's architecture: Kimi K2's says kimi_k2 and DeepseekV3ForCausalLM
ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}
MAPPED = tuple(name for name, family in FAMILIES.items() if family.megatron is not None)


def family_for(model_type, key: str) -> Family:
    """The family of an HF model_type; a UserInputError at `key` naming the supported ones otherwise."""
    model_type = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise UserInputError(key, f"family '{model_type}' is not supported; supported: "
                                  f"{', '.join(sorted({*FAMILIES, *ALIASES}))}")
    return FAMILIES[model_type]


def megatron_mapping(model_type) -> MegatronMapping:
    """The Megatron-Core mapping of an HF model_type; a UserInputError naming the mapped families otherwise."""
    family = FAMILIES.get(ALIASES.get(model_type, model_type)) if isinstance(model_type, str) else None
    if family is None or family.megatron is None:
        raise UserInputError("model.source", f"no Megatron-Core mapping for model family '{model_type}'; supported: "
                                             f"{', '.join(sorted(MAPPED))}")
    return family.megatron


def megatron_fields(hf_config: dict) -> dict[str, dict]:
    """Megatron sections (`transformer_config`, `gpt_model`, `model`) of an HF config dict, by its family's table."""
    return megatron_mapping(hf_config.get("model_type")).megatron_fields(hf_config)
