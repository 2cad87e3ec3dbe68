"""A suffix array over a token array, and where a token run occurs in it.

REST's datastore (speculators/datastore.py) answers "where did this run of tokens occur in the
corpus?" with a binary search over the corpus's suffixes in sorted order: every occurrence of a
run is one contiguous range of the suffix array, found in O(run length x log n) whatever the
corpus's size, with nothing in memory but the two arrays (which may be memory-mapped).

Suffixes compare token by token, a suffix that ends first sorting before any longer one that
agrees with it that far; a negative token (the datastore's document separator) sorts before every
real token, so a run of real tokens never matches across it.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The start positions of `tokens`' suffixes in sorted order (int32 while it fits, else int64).

    Prefix doubling: after round k every suffix holds the rank of its first 2^k tokens, and the
    ranks of (first half, second half) pairs, one sort of int64 keys a round, give the next round's.
    It stops once every rank is distinct, so rounds grow with the log of the longest repeated run,
    not with n: O(n log n) a round in numpy, seconds for a few million tokens.
    """
    n = len(tokens)
    dtype = np.int32 if n < 2**31 else np.int64
    if n == 0:
        return np.empty(0, dtype)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(n)
    step = 1
    while True:
        following = np.zeros(n, np.int64)  # 0: the suffix ends within this step, so it sorts first
        if step < n:
            following[:n - step] = rank[step:] + 1
        key = rank * (n + 1) + following  # < n^2 + n: fits int64 for any n that fits int32
        order = np.argsort(key)
        ordered = key[order]
        distinct = np.empty(n, np.int64)
        distinct[0] = 0
        np.cumsum(ordered[1:] != ordered[:-1], out=distinct[1:])
        rank = np.empty(n, np.int64)
        rank[order] = distinct
        if distinct[-1] == n - 1:
            return order.astype(dtype)
        step *= 2


def occurrences(tokens: np.ndarray, suffixes: np.ndarray, run: Sequence[int]) -> tuple[int, int]:
    """The range [lo, hi) of `suffixes` whose suffixes begin with `run` (empty: lo == hi)."""
    run = tuple(int(token) for token in run)
    length = len(run)

    def head(start) -> tuple[int, ...]:
        return tuple(tokens[start:start + length].tolist())

    lo = bisect_left(suffixes, run, key=head)
    return lo, bisect_right(suffixes, run, lo=lo, key=head)
