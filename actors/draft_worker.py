"""The draft side: one proposer and the per-request state it keeps, behind a small API.

A draft worker learns what the target accepted from the token ids of the next `propose` call, so
the engine never needs a separate round trip to roll it back. It runs in-process (the CLI) or as a
Ray actor on its own GPU set (the cluster); a restarted actor simply rebuilds each request's state
from those token ids.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from speculators.proposers.base import DraftRequest, Proposer
from speculators.tree import DraftTree


class DraftWorker:
    def __init__(self, build_proposer: Callable[[], Proposer]):
        """`build_proposer` runs where the worker lives, so a Ray actor loads its own draft model."""
        self.proposer = build_proposer()

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        for request in requests:
            self.proposer.on_accept(request.request_id, request.token_ids)
        return self.proposer.propose(requests)

    def release(self, request_ids: Sequence[str], outputs: Sequence[Sequence[int]] = ()) -> None:
        """Free finished requests' state, and learn from the outputs of those that completed (every
        draft actor gets every output, whichever actor drafted for the request)."""
        for request_id in request_ids:
            self.proposer.release(request_id)
        for output in outputs:
            self.proposer.learn(output)

    def runs_a_model(self) -> bool:
        return self.proposer.runs_a_model

    def ping(self) -> bool:
        return True
