"""The draft side: one proposer and the per-request state it keeps, behind a small API.

A draft worker learns what the target accepted from the token ids of the next `propose` call, so
the engine never needs a separate round trip to roll it back. Only the tokens committed since the
previous call travel (`DraftRequest.start`); the worker keeps each request's sequence. It runs
in-process (the CLI) or as a Ray actor on its own GPU set (the cluster); a restarted actor, which
has lost the sequences, names the requests it does not know and the engine sends them whole next
time.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from speculators.proposers.base import DraftRequest, Proposer
from speculators.tree import DraftTree


@dataclass
class DraftReply:
    trees: list[DraftTree]
    unknown: list[str]
    """Requests sent in part whose earlier tokens this worker does not have (root-only trees)."""


class DraftWorker:
    def __init__(self, build_proposer: Callable[[], Proposer]):
        """`build_proposer` runs where the worker lives, so a Ray actor loads its own draft model."""
        self.proposer = build_proposer()
        self._sequences: dict[str, list[int]] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> DraftReply:
        whole, unknown = [], []
        for request in requests:
            known = self._sequences.get(request.request_id, [])
            if request.start > len(known):
                unknown.append(request.request_id)
                continue
            tokens = known[: request.start] + list(request.token_ids)
            self._sequences[request.request_id] = tokens
            self.proposer.on_accept(request.request_id, tokens)
            whole.append(replace(request, token_ids=tokens, start=0))
        trees = iter(self.proposer.propose(whole))
        return DraftReply([DraftTree.root_only(r.token_ids[-1]) if r.request_id in unknown else next(trees)
                           for r in requests], unknown)

    def release(self, request_ids: Sequence[str], outputs: Sequence[Sequence[int]] = ()) -> None:
        """Free finished requests' state, and learn from the outputs of those that completed (every
        draft actor gets every output, whichever actor drafted for the request)."""
        for request_id in request_ids:
            self._sequences.pop(request_id, None)
            self.proposer.release(request_id)
        for output in outputs:
            self.proposer.learn(output)

    def runs_a_model(self) -> bool:
        return self.proposer.runs_a_model

    def hidden_spec(self) -> tuple[tuple[int, ...], str]:
        """The target hidden states the proposer reads, and their dtype's name (for the target)."""
        return tuple(self.proposer.hidden_layers), str(self.proposer.hidden_dtype).removeprefix("torch.")

    def ping(self) -> bool:
        return True
