"""Draft calls that carry only new tokens: the engine remembers what each draft worker has of each
request (what each request drafts is decided in speculation.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from speculators.proposers.base import DraftRequest


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
