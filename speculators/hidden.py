"""The target's hidden states on their way to a drafter that reads them (EAGLE, Medusa heads).

The target produces rows for the tokens it commits (a prefill: every prompt token but the last; a
verification pass: the tree root and the accepted nodes), always the next positions of the
request. The engine (or a co-located target shard) holds them until the request's next propose
call and hands them over once, so nothing is sent twice and the drafter keeps what it needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TargetHidden:
    """Hidden states of committed tokens at positions start .. start + len(states) - 1: [n, width]
    (width: the drafter's `hidden_layers` concatenated, len(hidden_layers) x the target's hidden size)."""

    start: int
    states: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.states.shape[0]


class PendingHidden:
    """Per request, the rows produced since its drafter last got them."""

    def __init__(self):
        self._pieces: dict[str, list[TargetHidden]] = {}

    def add(self, request_id: str, start: int, states: torch.Tensor) -> None:
        pieces = self._pieces.setdefault(request_id, [])
        if pieces and pieces[-1].end != start:
            pieces.clear()  # not contiguous: the drafter starts over from these rows
        pieces.append(TargetHidden(start, states))

    def take(self, request_id: str) -> TargetHidden | None:
        pieces = self._pieces.pop(request_id, None)
        if not pieces:
            return None
        if len(pieces) == 1:
            return pieces[0]
        return TargetHidden(pieces[0].start, torch.cat([piece.states for piece in pieces]))

    def drop(self, request_id: str) -> None:
        self._pieces.pop(request_id, None)
