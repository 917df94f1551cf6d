"""The one activation table: each HF activation name, what it makes of a gated or an ungated MLP in a ModelSpec, and
its Megatron-Core function (megatron.yaml stores the name; the generator builds, and the validator accepts, this list).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from toolkit.errors import UserInputError


@dataclass(frozen=True)
class Activation:
    gated: str  # ModelSpec.activation of a gated MLP (gate * act(up))
    ungated: str  # ModelSpec.activation of a plain MLP; the estimate costs every GELU-like function as gelu
    megatron: str | None  # megatron.yaml's name of the same function; None: Megatron-Core has no equivalent here


# The first HF name of each Megatron name is the one a converter writes back to config.json.
HF_ACTIVATIONS = {
    "silu": Activation("swiglu", "gelu", "silu"),
    "swish": Activation("swiglu", "gelu", "silu"),
    "gelu": Activation("geglu", "gelu", "gelu"),
    "gelu_new": Activation("geglu", "gelu", "openai_gelu"),
    "gelu_pytorch_tanh": Activation("geglu", "gelu", "openai_gelu"),
    "gelu_fast": Activation("geglu", "gelu", None),
    "quick_gelu": Activation("geglu", "gelu", None),
    "relu": Activation("relu", "relu", "relu"),
}

# megatron.yaml's activation names -> where Megatron-Core's training code finds the function (squared_relu has no HF
# counterpart here but is Megatron's own choice for a hand-written megatron.yaml).
MEGATRON_FUNCTIONS = {
    "silu": "torch.nn.functional:silu",
    "gelu": "torch.nn.functional:gelu",
    "openai_gelu": "megatron.core.transformer.utils:openai_gelu",
    "relu": "torch.nn.functional:relu",
    "squared_relu": "megatron.core.activations:squared_relu",
    "quick_gelu": "megatron.core.fusions.fused_bias_geglu:quick_gelu",  # GPT-OSS's experts (sigmoid(1.702 y) y)
}
MEGATRON_ACTIVATIONS = tuple(MEGATRON_FUNCTIONS)
HF_NAME_OF_MEGATRON = {a.megatron: hf for hf, a in reversed(HF_ACTIVATIONS.items()) if a.megatron}


def spec_activation(name: str, gated: bool, key: str) -> str:
    """ModelSpec.activation of an HF activation name read from config key `key`."""
    if name not in HF_ACTIVATIONS:
        raise UserInputError(key, f"activation '{name}' is not supported; expected silu, gelu or relu")
    activation = HF_ACTIVATIONS[name]
    return activation.gated if gated else activation.ungated


def megatron_activation(name: str) -> str:
    """HF activation name -> the name megatron.yaml stores (the builder maps it to the function)."""
    megatron = HF_ACTIVATIONS[name].megatron if name in HF_ACTIVATIONS else None
    if megatron is None:
        supported = sorted(hf for hf, a in HF_ACTIVATIONS.items() if a.megatron)
        raise UserInputError("model.config.hidden_act", f"activation '{name}' has no Megatron-Core equivalent here; "
                                                        f"supported: {', '.join(supported)}")
    return megatron


def hf_activation(megatron: str) -> str | None:
    """megatron.yaml's activation name -> the HF name a converter writes to config.json."""
    return HF_NAME_OF_MEGATRON.get(megatron)


def megatron_function(name: str):
    """The function behind an activation name of megatron.yaml (imports torch, and Megatron-Core for its own)."""
    if name not in MEGATRON_FUNCTIONS:
        raise ValueError(f"unknown activation '{name}'; one of {', '.join(MEGATRON_ACTIVATIONS)}")
    module, attribute = MEGATRON_FUNCTIONS[name].split(":")
    return getattr(importlib.import_module(module), attribute)
