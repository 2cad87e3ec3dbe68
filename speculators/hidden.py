"""The target's hidden states on their way to a drafter that reads them (EAGLE, Medusa heads).

The target produces rows for the tokens it commits (a prefill: every prompt token but the last; a
verification pass: the tree root and the accepted nodes), always the next positions of the
request. The engine (or a co-located target shard) holds them until the request's next propose
call and hands them over once, so nothing is sent twice and the drafter keeps what it needs. A
request that is not drafting (speculation off, its gate closed) keeps only its last rows
(IDLE_ROWS), and rows a draft call took but the drafter never used (a failed call) are put back.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

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


class RowState(Protocol):
    """A drafter's per-request state of committed rows, positions first .. end - 1."""

    first: int

    @property
    def end(self) -> int: ...

    def cut(self, end: int) -> None:
        """Keep positions before `end`."""


S = TypeVar("S", bound=RowState)


class CommittedRows(Generic[S]):
    """Per request, the state a drafter keeps of the target rows of committed tokens (an EAGLE
    head's K/V, a DFlash drafter's context): rolled back past a shorter sequence, and started over
    where new rows do not join it (a drafter restart, a lost call)."""

    def __init__(self, new: Callable[[int], S]):
        """`new(first)`: an empty state whose rows start at position `first`."""
        self._new, self._states = new, {}

    def __getitem__(self, request_id: str) -> S:
        return self._states[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Rows past the root's parent cannot be valid any more (a shorter sequence)."""
        state = self._states.get(request_id)
        if state is not None:
            state.cut(len(token_ids) - 1)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def new_rows(self, requests) -> list[tuple[object, S, TargetHidden]]:
        """(request, its state cut to where its new rows start, the rows) of each DraftRequest that
        brought rows; every request gets a state."""
        runs = []
        for request in requests:
            state = self._states.setdefault(request.request_id, self._new(0))
            rows = request.hidden
            if rows is None or rows.states.shape[0] == 0:
                continue
            if not state.first <= rows.start <= state.end:
                self._states[request.request_id] = state = self._new(rows.start)
            state.cut(rows.start)
            runs.append((request, state, rows))
        return runs
