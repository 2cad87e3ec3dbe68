"""Presence, frequency and repetition penalties, applied to a model's logits at any tree node.

A penalty depends on the tokens before the position it scores: the committed ones and, inside a
draft tree, the drafted tokens on the node's own path. The target applies it at every verified node
and a draft model at every drafted one, each given that node's path, so the verifier compares two
distributions penalised by the same rule and sampled output is lossless with respect to the
penalised target distribution (greedy output is its argmax).

The rule is vLLM's (and OpenAI's for presence and frequency), on raw logits before temperature,
top-k and top-p: repetition_penalty r divides a positive logit by r and multiplies a negative one by
r for every token seen in the prompt or the output (transformers' rule); frequency_penalty f
subtracts f x the token's count in the output; presence_penalty p subtracts p once when it occurs
in the output at all.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_ADDITIVE = 2.0
"""OpenAI's range for presence_penalty and frequency_penalty is [-2, 2]."""


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self):
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency),
                            ("repetition_penalty", self.repetition)):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number")
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -MAX_ADDITIVE <= value <= MAX_ADDITIVE:
                raise ValueError(f"{name} must be in [-{MAX_ADDITIVE:g}, {MAX_ADDITIVE:g}]")
        if self.repetition <= 0:
            raise ValueError("repetition_penalty must be > 0 (1 = off)")

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


@dataclass
class PenaltyContext:
    """A request's penalties and what they count: its committed tokens, prompt first."""

    penalties: Penalties
    tokens: Sequence[int]
    prompt_length: int


def penalize(logits: torch.Tensor, context: PenaltyContext, paths: Sequence[Sequence[int]]) -> torch.Tensor:
    """`logits` [n, V] with row i penalised as if `paths[i]` (drafted tokens, oldest first) had been
    appended to the committed output."""
    penalties = context.penalties
    rows, vocab = logits.shape
    device = logits.device
    committed = torch.as_tensor(list(context.tokens), dtype=torch.long)
    counts = torch.bincount(committed[context.prompt_length:], minlength=vocab).to(device, logits.dtype)
    counts = counts.expand(rows, vocab).clone()
    row_ids = [row for row, path in enumerate(paths) for _ in path]
    if row_ids:
        counts.index_put_((torch.tensor(row_ids, device=device), torch.tensor([t for p in paths for t in p], device=device)),
                          torch.ones(len(row_ids), dtype=logits.dtype, device=device), accumulate=True)
    out = logits.clone()
    if penalties.repetition != 1:
        in_prompt = torch.bincount(committed[:context.prompt_length], minlength=vocab).to(device) > 0
        seen = (counts > 0) | in_prompt
        scaled = torch.where(out > 0, out / penalties.repetition, out * penalties.repetition)
        out = torch.where(seen, scaled, out)
    if penalties.frequency:
        out = out - penalties.frequency * counts
    if penalties.presence:
        out = out - penalties.presence * (counts > 0).to(out.dtype)
    return out
