"""Keyed sampling: the token at a position drawn with noise that depends on (seed, position) alone.

Gumbel-max, written as the exponential race: with E_i independent Exp(1) variables, argmax_i p_i / E_i
is distributed as p (log p_i - log E_i is p's Gumbel-max). When E is a fixed function of the
request's seed and the sampled token's position in the sequence, the token chosen at a position
depends only on the seed, the position and the target's distribution there. Verifying a drafted
token is then asking whether it equals that sample, and the output is the same, token for token,
whatever was drafted (nothing, for plain decoding), however requests were batched and wherever they
ran. The top k of log q + g are k draws from q without replacement (Gumbel-top-k): the drafters draw
with the same noise at the same position (speculators.sampling.DraftNoise), so a sampled draft tends
to agree with the target's sample.

The noise is a counter-based hash of (seed, position, token) in integer tensor ops on the
distribution's device: no generator state, no host round trip, the same numbers on every device.
"""
from __future__ import annotations

import functools

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
"""The 'lowbias32' integer hash (C. Wellons): x ^= x >> 16; x *= a; x ^= x >> 15; x *= b; x ^= x >> 16."""


def _mix_scalar(x: int) -> int:
    x ^= x >> 16
    x = (x * _MULTIPLIERS[0]) & _MASK32
    x ^= x >> 15
    x = (x * _MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 16)


def _times(x: torch.Tensor, multiplier: int) -> torch.Tensor:
    """x * multiplier mod 2^32 for int64 x in [0, 2^32), in halves so no product overflows int64."""
    high, low = multiplier >> 16, multiplier & 0xFFFF
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _times(x, _MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _times(x, _MULTIPLIERS[1])
    return x ^ (x >> 16)


def _key(*fields: int) -> int:
    """One 32-bit key from integer fields (each folded to 64 bits, fed 32 bits at a time)."""
    key = 0
    for value in fields:
        value %= 2**64
        for half in (value & _MASK32, value >> 32):
            key = _mix_scalar((key ^ half) + _GOLDEN & _MASK32)
    return key


@functools.lru_cache(maxsize=8)
def _counters(size: int, device: torch.device) -> torch.Tensor:
    """mix(i) for every token i: the per-token half of the hash, the same for every key."""
    return _mix(torch.arange(size, dtype=torch.int64, device=device))


def keyed_uniform(seed: int, position: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`size` uniforms in (0, 1), float64, 52 random bits each: a function of (seed, position) only.
    (bits + 0.5) / 2^52 is exact in float64 and never 0 or 1, so its logarithm is finite and non-zero."""
    counters = _counters(size, torch.device(device))
    high = _mix(counters ^ _key(seed, position, 0)) >> 6
    low = _mix(counters ^ _key(seed, position, 1)) >> 6
    return ((high << 26) + low).double().add_(0.5).mul_(2.0 ** -52)


def keyed_exponential(seed: int, position: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`size` Exp(1) variables (float64, never 0): the race's noise at `position`."""
    return keyed_uniform(seed, position, size, device).log_().neg_()


def keyed_sample(probs: torch.Tensor, seed: int, position: int) -> int:
    """The token at `position` of a request seeded `seed`, given the distribution `probs` [V] there.
    Raises on a row that is no distribution (NaN, or no token possible), as torch.multinomial does."""
    race = probs.double() / keyed_exponential(seed, position, probs.shape[-1], probs.device)
    token = int(race.argmax())  # a NaN wins the argmax
    if not float(race[token]) > 0:
        raise ValueError("the distribution to sample from has no token with a finite probability above 0")
    return token
