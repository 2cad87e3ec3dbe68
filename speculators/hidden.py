"""The target's hidden states on their way to a drafter that reads them (EAGLE, Medusa heads).

The target produces rows for the tokens it commits (a prefill: every prompt token but the last; a
verification pass: the tree root and the accepted nodes), always the next positions of the
request. The engine (or a co-located target shard) holds them until the request's next propose
call and hands them over once, so nothing is sent twice and the drafter keeps what it needs. A
request that is not drafting (speculation off, its gate closed) keeps only its last rows
(IDLE_ROWS), and rows a draft call took but the drafter never used (a failed call) are put back.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

IDLE_ROWS = 64
"""Rows kept for a request left out of draft calls: a head drafting for it again starts from these
(Medusa reads the last one; EAGLE starts over from them, as after any gap). Such a request holds at
most 2 x IDLE_ROWS rows and one step's, not a row for every token it has."""


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

    def idle(self, request_ids: Iterable[str]) -> None:
        """These requests draft nothing this step: past 2 x IDLE_ROWS rows, each keeps its last
        IDLE_ROWS (a copy once in IDLE_ROWS rows, not every step; a view would hold what it drops)."""
        for request_id in request_ids:
            pieces = self._pieces.get(request_id, ())
            if sum(piece.states.shape[0] for piece in pieces) > 2 * IDLE_ROWS:
                whole = self.take(request_id)
                self._pieces[request_id] = [TargetHidden(whole.end - IDLE_ROWS, whole.states[-IDLE_ROWS:].clone())]

    def put_back(self, request_id: str, hidden: TargetHidden) -> None:
        """Rows a draft call took and its drafter never used go back before those that came since
        (when they join them: otherwise the drafter starts over from the newer rows, as in `add`)."""
        pieces = self._pieces.setdefault(request_id, [])
        if not pieces or pieces[0].start == hidden.end:
            pieces.insert(0, hidden)
