"""Hidden states for training, taken from the decoding passes that write the responses.

The target's prefill and verification passes already compute every hidden state a head reads,
and the engine hands them to a drafter that asks (`Proposer.hidden_layers`). `HiddenRecorder`
is such a drafter: it drafts with another proposer (prompt lookup) and keeps the rows it is given.
So the training data costs no second pass over the text, and its features are exactly the ones a
head gets when serving (same dtype, same packed passes). Rows of the last pass of a request never
reach a drafter; a sequence is kept up to its last recorded row.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from speculators.proposers.base import DraftRequest, Proposer
from speculators.tree import DraftTree


class HiddenRecorder(Proposer):
    name = "recorder"

    def __init__(self, inner: Proposer, layers: Sequence[int], dtype: torch.dtype = torch.bfloat16):
        """`dtype`: how the rows are kept (the target sends them in its own dtype)."""
        self.inner, self.store_dtype = inner, dtype
        self.hidden_layers = tuple(layers)
        self._rows: dict[str, list[torch.Tensor]] = {}

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.inner.on_accept(request_id, token_ids)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        for request in requests:
            rows = request.hidden
            if rows is None:
                continue
            kept = self._rows.setdefault(request.request_id, [])
            if rows.start != sum(piece.shape[0] for piece in kept):
                raise RuntimeError(f"{request.request_id}: hidden rows from {rows.start} do not continue the recorded ones")
            kept.append(rows.states.to(self.store_dtype))
        return self.inner.propose(requests)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def collect(self, request_id: str) -> torch.Tensor | None:
        """The request's recorded rows (positions 0, 1, ...), forgotten here."""
        kept = self._rows.pop(request_id, None)
        return torch.cat(kept) if kept else None
