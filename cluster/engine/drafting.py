"""Draft calls that carry only new tokens: the engine remembers what each draft worker has of each
request (what each request drafts is decided in speculation.py), and what a call in flight took.
"""
from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from speculators.hidden import PendingHidden, TargetHidden
from speculators.proposers.base import DraftRequest


@dataclass
class PendingDraft:
    future: Future
    drafter: int
    request_ids: list[str]
    submitted: float
    """When the draft was asked for: its wall time (overlapping a verify when pipelined) is shared
    by its requests as their draft time."""
    rows: int
    """Tokens the drafter catches up on in this call (what it had not seen of each request)."""
    hidden: dict[str, TargetHidden | None] = field(default_factory=dict)
    """The target's hidden states the call took, per request."""
    engine_seconds: float | None = 0.0
    """What the call cost the engine's thread: building and sending it, then waiting for its trees
    (not the drafting it overlapped); None once it failed."""

    def give_back(self, pending: PendingHidden, request_ids: Iterable[str], active: Container[str]) -> None:
        """The rows of these requests go back to `pending` (their drafter never used them: the call
        failed, or it did not know them), for those still `active`: a head's context stays whole."""
        for request_id in request_ids:
            rows = self.hidden.get(request_id)
            if rows is not None and request_id in active:
                pending.put_back(request_id, rows)


class SentTokens:
    """What one draft worker already has of each request, so that a call carries only new tokens."""

    def __init__(self):
        self._sent: dict[str, int] = {}

    def outgoing(self, requests: Sequence[DraftRequest]) -> list[DraftRequest]:
        """The requests as sent: each request's tokens past what this worker has."""
        sent = []
        for request in requests:
            start = min(self._sent.get(request.request_id, 0), len(request.token_ids) - 1)
            sent.append(replace(request, token_ids=list(request.token_ids[start:]), start=start))
            self._sent[request.request_id] = len(request.token_ids)
        return sent

    def forget(self, request_ids: Sequence[str] | None = None) -> None:
        """Send these requests (None: all) whole next time: finished, or the worker lost them."""
        if request_ids is None:
            self._sent.clear()
        for request_id in request_ids or ():
            self._sent.pop(request_id, None)
