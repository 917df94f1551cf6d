"""Megatron-LM's pretrain_gpt.py parser at the pinned tag, as recorded in megatron/megatron_lm_flags.txt (by
megatron/record_megatron_lm_flags.py from the real parser), and the validate_args asserts that apply to what the
toolkit generates: every megatron_args.txt is checked against both, since Megatron-LM is not installable here."""

import shlex
from pathlib import Path

TABLE = Path(__file__).resolve().parent / "megatron" / "megatron_lm_flags.txt"
FLAGS = dict(line.split(" ", 1) for line in TABLE.read_text().splitlines() if line.startswith("--"))
# megatron/training/arguments.py validate_args at core_v0.16.1, the asserts the generated flags can reach:
# - line 927-953: tensor or context parallelism before Blackwell (and without FSDP or MoE-overlap) asserts
#   os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1": the launch files must export it.
# - line 852-854: --moe-grouped-gemm asserts a compute capability >= 8 (Ampere on): every GPU of the catalogue.
CONNECTIONS_ASSERT = "CUDA_DEVICE_MAX_CONNECTIONS=1"


def _parses(value: str, kind: str) -> bool:
    base = kind.split("{")[0].rstrip("?*+")
    choices = kind.split("{", 1)[1].rstrip("}").split(",") if "{" in kind else None
    if choices is not None and value not in choices:
        return False
    try:
        {"int": int, "float": float}.get(base, str)(value)
    except ValueError:
        return False
    if base == "tuple_type":  # --window-size a,b
        return all(part.strip().lstrip("-").isdigit() for part in value.split(","))
    return True


def problems(text: str) -> list[str]:
    """What Megatron-LM's parser would refuse in a megatron_args.txt: unknown flags, values of the wrong type or not
    among the choices, a switch given a value, a flag given twice."""
    found, seen = [], set()
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        flag, *values = shlex.split(line)
        kind = FLAGS.get(flag)
        if kind is None:
            found.append(f"{flag}: not a flag of Megatron-LM's parser")
        elif kind == "switch" and values:
            found.append(f"{flag}: a switch, given {values}")
        elif kind != "switch" and not values and not kind.endswith(("*", "?")):
            found.append(f"{flag}: needs a value ({kind})")
        elif len(values) > 1 and not kind.split("{")[0].endswith(("*", "+")):
            found.append(f"{flag}: one value expected, got {values}")
        else:
            found += [f"{flag} {v}: not {kind}" for v in values if not _parses(v, kind)]
        if flag in seen:
            found.append(f"{flag}: given twice")
        seen.add(flag)
    return found
