"""A blend's split: Megatron's train,valid,test shares of each dataset's documents, as --split and
GPTDatasetConfig.split take them."""

from __future__ import annotations

SPLIT_SHARES = 3  # train, valid, test (Megatron-Core's Split)


def split_shares(split: str) -> list[float]:
    """The train/valid/test shares of a Megatron split string ("969,30,1"; fewer parts are padded with 0), as
    Megatron-Core's parse_and_normalize_split reads it; ValueError naming what is wrong."""
    parts = [part.strip() for part in split.split(",")] if split.strip() else []
    try:
        shares = [float(part) for part in parts]
    except ValueError:
        shares = []
    if not 1 <= len(parts) <= SPLIT_SHARES or len(shares) != len(parts) or \
            any(not share >= 0 or share == float("inf") for share in shares) or sum(shares) <= 0:
        raise ValueError(f"{split!r}: give 1 to {SPLIT_SHARES} comma-separated non-negative numbers, train,valid,test "
                         f"shares with a positive sum (e.g. '969,30,1')")
    return shares + [0.0] * (SPLIT_SHARES - len(shares))


def megatron_split(split: str) -> str:
    """A split as Megatron-LM's --split and GPTDatasetConfig.split take it: three shares, train,valid,test."""
    return ",".join(f"{share:g}" for share in split_shares(split))
