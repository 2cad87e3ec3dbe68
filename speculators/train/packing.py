"""Sequences laid end to end for one training step, and the index arithmetic heads train with.

Row j of a sequence is the target's hidden state after its token j; a head pairs it with token
j + 1. `Packed` keeps, per row, where its sequence's tokens are, so "the token s places after row
j" and "is that token part of the response" are one gather each.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculators.train.dataset import Example


@dataclass
class Packed:
    hidden: torch.Tensor  # [N, width]
    tokens: torch.Tensor  # every token of the batch's sequences, end to end
    sequence: torch.Tensor  # [N] which sequence each row belongs to
    local: torch.Tensor  # [N] j: the row's position in its sequence
    first_token: torch.Tensor  # [N] index in `tokens` of its sequence's token 0
    length: torch.Tensor  # [N] tokens in its sequence
    prompt: torch.Tensor  # [N] prompt tokens in its sequence

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    def token(self, offset: int) -> torch.Tensor:
        """Token j + offset for every row j (clamped to the sequence's last token)."""
        index = torch.minimum(self.local + offset, self.length - 1)
        return self.tokens[self.first_token + index]

    def response_label(self, offset: int) -> torch.Tensor:
        """Whether token j + offset exists and belongs to the response (a label worth learning)."""
        index = self.local + offset
        return (index < self.length) & (index >= self.prompt)

    def causal_mask(self) -> torch.Tensor:
        """[N, N]: row j may attend rows j' <= j of its own sequence."""
        same = self.sequence[:, None] == self.sequence[None, :]
        return same & (self.local[None, :] <= self.local[:, None])


def pack(examples: Sequence[Example], dtype: torch.dtype = torch.float32) -> Packed:
    hidden, tokens, sequence, local, first, length, prompt = [], [], [], [], [], [], []
    offset = 0
    for index, example in enumerate(examples):
        rows, count = example.hidden.shape[0], len(example.tokens)
        hidden.append(example.hidden)
        tokens.append(example.tokens)
        sequence.append(torch.full((rows,), index))
        local.append(torch.arange(rows))
        first.append(torch.full((rows,), offset))
        length.append(torch.full((rows,), count))
        prompt.append(torch.full((rows,), example.prompt_length))
        offset += count
    return Packed(hidden=torch.cat(hidden).to(dtype), tokens=torch.cat(tokens), sequence=torch.cat(sequence),
                  local=torch.cat(local), first_token=torch.cat(first), length=torch.cat(length), prompt=torch.cat(prompt))


def batches(examples: Sequence[Example], max_rows: int, seed: int) -> list[list[int]]:
    """Example indices grouped into batches of at most `max_rows` rows, in a seeded random order
    (an example longer than that is a batch of its own)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    groups, current, rows = [], [], 0
    for index in order:
        size = examples[index].hidden.shape[0]
        if current and rows + size > max_rows:
            groups.append(current)
            current, rows = [], 0
        current.append(index)
        rows += size
    if current:
        groups.append(current)
    return groups
