"""DDP: every rank holds the whole model; no parallelism but data parallelism."""

from toolkit.errors import UserInputError
from toolkit.spec.options import flag

FOREIGN: dict[str, str] = {}
FINETUNE_REFUSED: dict[str, str] = {}
EP_REFUSAL = "DDP replicates every expert on every rank"


def fill(values: dict) -> None:
    values["transformer_impl"] = None


def check_steps(steps: int, warmup: int, key: str) -> None:
    """Any run length."""


def check(p) -> None:
    for name in ("tp", "pp", "vpp", "cp", "ep"):
        if getattr(p, name) > 1:
            raise UserInputError(flag(name), "DDP replicates the whole model: data parallelism only")
    if p.recompute == "selective" or p.precision == "fp8":
        raise UserInputError("--recompute" if p.recompute == "selective" else "--precision", "not with DDP")
