"""The draft vocabulary of a head (FR-Spec): the target's most frequent output tokens.

A head that scores 8,192 tokens instead of 49,152 pays a sixth of the LM head's cost at every
drafted token; verification still scores the full vocabulary, so output stays lossless, and a
token outside the draft vocabulary is simply never drafted.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def frequent_tokens(sequences: Iterable[torch.Tensor], size: int, vocab_size: int) -> torch.Tensor:
    """Target ids of the `size` most frequent tokens (ties: lower id first), most frequent first."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in sequences:
        counts += torch.bincount(tokens, minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda token: (-int(counts[token]), token))
    return torch.tensor(order[:min(size, vocab_size)])


def coverage(sequences: Iterable[torch.Tensor], vocabulary: torch.Tensor, vocab_size: int) -> float:
    """Share of the tokens in `sequences` that the vocabulary holds."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocabulary] = True
    hits = total = 0
    for tokens in sequences:
        hits += int(inside[tokens].sum())
        total += len(tokens)
    return hits / total if total else 0.0
