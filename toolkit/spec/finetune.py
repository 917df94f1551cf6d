"""What a run trains, declared once: every parameter, or LoRA adapters (PEFT) on a frozen base, in bf16 or in 4-bit nf4.

`FinetuneOptions` is the recipe's `finetune:` section; the flags of every command that takes plan options
(`--finetune --lora-r --lora-alpha --lora-dropout --lora-target-modules`, toolkit.cli.options) are derived from its
fields, and the resolved `Plan` carries it (plan.json records it, the memory and step-time models read it). The rules
between a method and the plan are `check_finetune`, called by the plan's validator.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from toolkit.errors import UserInputError
from toolkit.families.linears import LINEARS, MOE, Linear
from toolkit.numeric import FINITE, FiniteNumber
from toolkit.spec.backends import backend_of

Method = Literal["full", "lora", "qlora"]
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear module but the output head
# bitsandbytes 4-bit settings of QLoRA (Dettmers et al., arXiv:2305.14314): NormalFloat4 in blocks of 64 with
# double quantisation of the fp32 block scales (8-bit, in blocks of 256 with one fp32 scale each)
NF4_BLOCK = 64
NF4_SCALE_BLOCK = 256


def setting(default: Any, description: str, *, flag: str, metavar: str | None = None) -> Any:
    """A FinetuneOptions field: its default, help text and command-line flag (the recipe key is `finetune.<name>`)."""
    extra = {"flag": flag, **({"metavar": metavar} if metavar else {})}
    return Field(default, description=description, json_schema_extra=extra)


class FinetuneOptions(BaseModel):
    """How the model is trained: all of it, or low-rank adapters on its frozen (optionally 4-bit) linear layers."""

    model_config = ConfigDict(extra="forbid", frozen=True, **FINITE)

    method: Method = setting("full", "what trains: every parameter (full), LoRA adapters on a frozen base (lora, "
                                     "PEFT), or LoRA on a base loaded in 4-bit nf4 (qlora, PEFT + bitsandbytes)",
                             flag="--finetune")
    r: Annotated[StrictInt, Field(ge=1)] = setting(16, "LoRA rank", flag="--lora-r")
    alpha: Annotated[FiniteNumber, Field(gt=0)] = setting(
        32, "LoRA alpha: adapters are scaled by alpha / r", flag="--lora-alpha")
    dropout: Annotated[FiniteNumber, Field(ge=0, lt=1)] = setting(
        0.0, "dropout on the adapters' input", flag="--lora-dropout")
    target_modules: tuple[str, ...] = setting(
        (ALL_LINEAR,), "linear modules that get adapters, by name as PEFT matches them (q_proj,v_proj), or "
                       "all-linear (every linear layer but the output head)", flag="--lora-target-modules",
        metavar="q_proj,k_proj,...|all-linear")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _comma_list(cls, value):
        """`q_proj,v_proj`, as the flag gives it, is the list [q_proj, v_proj]."""
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)) and not value:
            raise ValueError("got no module; give a comma list of module names or all-linear")
        return value

    @property
    def peft(self) -> bool:
        """Adapters on a frozen base (lora, qlora)."""
        return self.method != "full"

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


FINETUNE_NAMES = tuple(FinetuneOptions.model_fields)


def finetune_flag(name: str) -> str:
    return FinetuneOptions.model_fields[name].json_schema_extra["flag"]


def finetune_key(name: str) -> str:
    return f"finetune.{name}"


def finetune_field(key: str) -> str | None:
    """The field a flag (`--lora-r`) or recipe key (`finetune.r`) names, if any."""
    for name in FINETUNE_NAMES:
        if key in (finetune_flag(name), finetune_key(name)):
            return name
    return None


def lora_linears(family: str, targets: tuple[str, ...]) -> tuple[Linear, ...]:
    """The family's linear modules the targets name, as PEFT matches them: a name equal to the module's path or to
    its last dotted parts (`q_proj`, `self_attn.q_proj`), or all-linear. A target naming none is refused, where PEFT
    would adapt the others and say nothing of it."""
    linears = LINEARS.get(family)
    if linears is None:
        raise UserInputError("--finetune", f"LoRA targets are declared for {', '.join(sorted(LINEARS))}, not for "
                                           f"model family '{family}'")
    if ALL_LINEAR in targets and family in MOE:
        raise UserInputError("--lora-target-modules", f"{ALL_LINEAR} on {family}: PEFT also adapts the routed experts' "
                                                      f"3-D parameters then (target_parameters), which is not modelled; "
                                                      f"name the attention projections (q_proj,k_proj,v_proj,o_proj)")
    if ALL_LINEAR in targets:
        if len(targets) > 1:
            raise UserInputError("--lora-target-modules", f"{ALL_LINEAR} already names every linear layer; give it "
                                                          f"alone")
        return linears

    def named(linear: Linear, target: str) -> bool:
        return linear.name == target or linear.name.endswith("." + target)

    for target in targets:
        if not any(named(linear, target) for linear in linears):
            valid = sorted({linear.name.rsplit(".", 1)[-1] for linear in linears})
            raise UserInputError("--lora-target-modules", f"'{target}' names no linear module of {family}; valid: "
                                                          f"{', '.join(valid)} or {ALL_LINEAR}")
    return tuple(linear for linear in linears if any(named(linear, target) for target in targets))


def check_finetune(plan, model) -> None:
    """The rules between the method and the plan (called by Plan's validator; `model` may be None)."""
    ft = plan.finetune
    if not ft.peft:
        return
    refused = backend_of(plan).rules.FINETUNE_REFUSED.get(ft.method)  # what the backend cannot train
    if refused:
        raise UserInputError("--finetune", refused)
    if plan.precision in ("fp8", "fp4"):
        raise UserInputError("--precision", f"{plan.precision} is modelled for Megatron-Core only; LoRA trains in "
                                            f"bf16, fp16 or fp32")
    if ft.method == "qlora":
        if plan.offload_params != "none":
            raise UserInputError("--offload-params", "a 4-bit base is frozen and already small: parameter offload of "
                                                     "bitsandbytes' packed weights is not supported; use --finetune "
                                                     "lora to offload a bf16 base")
    if model is not None:
        lora_linears(model.family, ft.target_modules)
