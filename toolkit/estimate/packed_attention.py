"""The attention work of a packed sample: the expected sum of its document pieces' squared lengths, where a
variable-length kernel keeps documents apart, instead of the whole sequence's square.

GPTDataset (megatron/core/datasets/gpt_dataset.py) cuts its samples of seq_len tokens out of the concatenated,
shuffled documents of a prefix, whatever their boundaries: a sample is a window at an offset that falls anywhere in
the stream. The pieces are the window's cuts of the documents it overlaps (with reset_position_ids the position ids
restart after each end-of-document token, and transformers' flash attention turns those restarts into cu_seqlens). The
sum of a sample's squared piece lengths counts its ordered token pairs (i, j) that share a document, so its
expectation over a window of S tokens is

    E[sum l^2] = S + 2 * sum_{d=1}^{S-1} (S - d) * P(two tokens d apart share a document)

and, for a token of the stream (in a document of length L with the length-biased probability L p(L) / E[L], at a
uniform place in it), P(d) = E[(L - d)+] / E[L]. Documents longer than the sample are clipped by the window itself.
A blend's sample comes whole from one of its prefixes (BlendedDataset draws samples by weight), so its expectation
is the prefixes' weighted by the blend weights. tests/data/test_packed_attention.py checks it against the samples
Megatron-Core's own GPTDataset builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from toolkit.spec.prediction import PackedAttention

if TYPE_CHECKING:
    import numpy


def squared_pieces_per_sample(lengths: Sequence[int] | numpy.ndarray, seq_len: int) -> float:
    """E[sum of squared piece lengths] of a sample of `seq_len` tokens cut from documents of these lengths (tokens,
    end-of-document token included). Every document's share is closed-form, so this is one pass over the index."""
    import numpy  # only where document lengths are given: every estimate imports this module

    length = numpy.asarray(lengths, dtype=numpy.float64)
    tokens = float(length.sum())
    if tokens == 0:  # no document: nothing to tell the sequence apart
        return float(seq_len) ** 2
    s = float(seq_len)
    # sum_{d=1}^{n} (S - d)(L - d) with n = min(L, S) - 1: S·L·n - (S + L)·n(n+1)/2 + n(n+1)(2n+1)/6
    n = numpy.maximum(numpy.minimum(length, s) - 1, 0)
    pairs = s * length * n - (s + length) * n * (n + 1) / 2 + n * (n + 1) * (2 * n + 1) / 6
    return s + 2 * float(pairs.sum()) / tokens


def blend_squared_pieces(datasets: Sequence[tuple[float, Sequence[int] | numpy.ndarray]], seq_len: int) -> float:
    """squared_pieces_per_sample of a blend: each prefix's (weight, document lengths), weights normalised as
    Megatron's --data-path normalises them."""
    total = sum(weight for weight, _ in datasets)
    return sum(weight * squared_pieces_per_sample(lengths, seq_len) for weight, lengths in datasets) / total


def attended_tokens(seq_len: int, packed: PackedAttention | None) -> float:
    """The tokens one token's attention spans in the FLOP count (the PaLM convention's full score matrix: seq_len per
    token), or over packed documents E[sum l^2] / seq_len: what flops.py's attention term multiplies."""
    if packed is None or packed.squared_pieces is None:
        return float(seq_len)
    return packed.squared_pieces / seq_len
