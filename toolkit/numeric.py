"""What a number from elsewhere may be: finite (never NaN, inf or -inf), and an integer bounded by what its consumers
accept. Declared once: the pydantic types and config, the argparse types of number flags, the walk that finds a
non-finite number in parsed JSON or YAML, and the JSON/YAML writers that refuse to write one; and the one binary
unit memory is shown in (GiB)."""

# named numeric, not numbers: toolkit/train.py run by its path (the launchers run `-m toolkit.train`) puts toolkit/
# first on sys.path, where a numbers.py would stand in for the standard library's (which numpy and torch import)
from __future__ import annotations

import argparse
import json
import math
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field, StrictFloat, StrictInt

# pydantic's own switch: a model whose config includes FINITE refuses nan, inf and -inf in every float field (nested
# ones too: dict values, optional fields), so a field added later is covered without anyone remembering to
FINITE = ConfigDict(allow_inf_nan=False)
# a number a YAML or JSON file may give as 32 or 0.5, but not as true, "32", .nan or .inf
FiniteNumber = StrictInt | Annotated[StrictFloat, Field(allow_inf_nan=False)]

# bytes in a GiB: memory figures are shown in binary units, as torch's allocator and its OOM messages give them
GiB = 1024**3

# a training seed goes to HF's set_seed: random.seed (any int), numpy.random.seed (0 .. 2**32 - 1) and
# torch.manual_seed (-2**63 .. 2**64 - 1); numpy's range is the tightest, and the one every rank then survives
SEED_MAX = 2**32 - 1


def _seed(value: int) -> int:
    if not 0 <= value <= SEED_MAX:
        raise ValueError(f"must be 0 to {SEED_MAX} (numpy's seed range: HF's set_seed calls numpy.random.seed on every "
                         f"rank), got {value}")
    return value


Seed = Annotated[StrictInt, AfterValidator(_seed)]

# a count or size (GPUs, tokens, layers, batch): the estimates compute with them in floats, which hold integers exactly
# up to 2**53 and fail to convert (OverflowError) not far beyond 2**1023
COUNT_MAX = 2**53
PositiveInt = Annotated[StrictInt, Field(ge=1, le=COUNT_MAX)]

NOT_FINITE = "not a finite number"  # NaN, Infinity, and 1e999 (which parses as inf)


def is_finite_number(value: Any) -> bool:
    """An int or a finite float; never a bool (YAML's `true` is no 1)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def non_finite(data: Any) -> tuple[str, float] | None:
    """The dotted key (`optimizer.params.lr`, `runs[2].mfu`) and value of the first NaN or infinity in parsed JSON or
    YAML data, or None. Iterative: a deeply nested document does not exhaust Python's recursion limit here."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "(top level)", value
        if isinstance(value, dict):
            items = [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        pending.extend(reversed(items))  # depth first, in document order: the first one a reader would see
    return None


def _float_flag(text: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expects a finite number, got {text!r}")
    if positive and value <= 0:
        raise argparse.ArgumentTypeError(f"expects a positive number, got {text!r}")
    return value


def bounded_int(text: str) -> int:
    """argparse type of an integer flag: at most COUNT_MAX either way (each flag keeps its own rule for 0 and below),
    so that a 300-digit --gpus is one line naming the flag, not an OverflowError deep in an estimate."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects an integer, got {text[:40]!r}") from None
    if abs(value) > COUNT_MAX:
        raise argparse.ArgumentTypeError(f"expects an integer of at most {COUNT_MAX} (2**53), got {text[:40]!r}"
                                         f"{'...' if len(text) > 40 else ''}")
    return value


def finite_float(text: str) -> float:
    """argparse type of a float flag: `nan`, `inf`, `-inf` and `1e999` (a float's inf) are refused, naming the flag
    (argparse words it `argument --flag: expects a finite number, got 'nan'`, exit code 2)."""
    return _float_flag(text, positive=False)


def positive_float(text: str) -> float:
    """argparse type of a float flag that must be above 0 (a bandwidth): finite as well."""
    return _float_flag(text, positive=True)


class FloatRange:
    """argparse type of a float flag whose plausible values lie from `low` to `high` (`unit` names what it counts):
    finite, and refused in one line naming the flag beyond either end. Values past a plausible range are not
    wrong only in degree: the estimates raise them to powers and exponentials, where they overflow (OverflowError)
    or print as inf, nan or a 300-digit number with exit code 0."""

    def __init__(self, low: float, high: float, unit: str):
        self.low, self.high, self.unit = low, high, unit
        self.__name__ = "number"  # argparse's wording of a type it cannot name otherwise

    def __call__(self, text: str) -> float:
        value = _float_flag(text, positive=False)
        if not self.low <= value <= self.high:
            raise argparse.ArgumentTypeError(f"expects {self.unit} from {self.low:g} to {self.high:g}, got "
                                             f"{text[:40]!r}")
        return value

    def __repr__(self) -> str:
        return f"FloatRange({self.low:g}, {self.high:g}, {self.unit!r})"


def token_count(value: float, text: str) -> int:
    """A token budget (already a float: 15T, 1.5e12) as an int, at most COUNT_MAX."""
    if not (math.isfinite(value) and 1 <= value <= COUNT_MAX):
        raise argparse.ArgumentTypeError(f"expected a positive token count such as 15T, 300B or 1.5e12, at most "
                                         f"{COUNT_MAX:.3g}, got {text[:40]!r}")
    return round(value)


# blend weights (a recipe's data.blend, megatron.yaml's data section): relative shares, normalised by their sum; a
# token count (1e12) is a plausible weight, one past 1e15 or below 1e-15 is a slip (and a sum of weights near the
# float range overflows to inf, and every share to nan)
WEIGHT_MIN, WEIGHT_MAX = 1e-15, 1e15

# the plausible range of each failure and checkpoint assumption of --train-tokens (toolkit/cli/train_tokens.py): a
# failure per GPU-hour at most (Llama 3's was 2e-5), a week's restart, 1 MB/s to 1 PB/s of storage per node, a
# millisecond to a week per checkpoint write
WEEK_S = 7 * 24 * 3600.0
FAILURE_RATE = FloatRange(0, 1, "interruptions per GPU-hour")
RESTART = FloatRange(0, WEEK_S, "seconds")
WRITE_BW = FloatRange(1e-3, 1e6, "GB/s per node")
WRITE_TIME = FloatRange(1e-3, WEEK_S, "seconds")
PRICE = FloatRange(1e-6, 1e6, "a price per GPU-hour")
# how long `dmt health` waits for a silent rank or a collective, or runs its matmul benchmark: past a week it is no
# deadline (and past what a timedelta holds, its ranks died of an OverflowError)
DEADLINE = FloatRange(0, WEEK_S, "seconds")
# `dmt health`'s thresholds: a straggler's slowdown (a million times the median is no threshold) and a bus-bandwidth
# floor (1 PB/s per link is none either); past these, 1e300 passed every rank with exit 0
STRAGGLER = FloatRange(0, 1e6, "times the other ranks' median")
BUSBW = FloatRange(0, 1e6, "GB/s")
RANGES = (FAILURE_RATE, RESTART, WRITE_BW, WRITE_TIME, PRICE, DEADLINE, STRAGGLER, BUSBW)

# a calibration's fitted compute_scale (toolkit/spec/calibration.py): a rate relative to the published curve, so a
# factor of a million either way is no measurement
SCALE_MIN, SCALE_MAX = 1e-6, 1e6

# the argparse types of float flags (the explore form: number fields; the fuzz tests: every one refuses nan)
FLOAT_FLAGS = (finite_float, positive_float, *RANGES)
INT_FLAGS = (bounded_int,)


def _check_finite(data: Any, what: str) -> None:
    found = non_finite(data)
    if found is not None:  # a bug: every number from a user is checked on the way in, so this one was computed
        raise RuntimeError(f"internal error: {what} would hold {found[1]} at {found[0]}, {NOT_FINITE}; please "
                           f"report it")


def json_text(data: Any, what: str = "the JSON output", **kwargs) -> str:
    """JSON as every --json output and generated file is written: never `NaN` or `Infinity` (not JSON; Python's json
    writes them by default)."""
    _check_finite(data, what)
    return json.dumps(data, allow_nan=False, **kwargs)


def yaml_text(data: Any, what: str = "the YAML output", **kwargs) -> str:
    """YAML as generated files and calibrations are written: never `.nan` or `.inf`."""
    import yaml

    _check_finite(data, what)
    return yaml.safe_dump(data, **kwargs)


def divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of n in ascending order, at most `limit` (the sizes a parallel axis of n can take)."""
    # no divisor exceeds n: a limit of --gpus-per-node 10**100 must not count to it
    return [d for d in range(1, min(limit or n, n) + 1) if n % d == 0]
