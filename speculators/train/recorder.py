"""Hidden states for training, taken from the decoding passes that write the responses.

The target's prefill and verification passes already compute every hidden state a head reads,
and the engine hands them to a drafter that asks (`Proposer.hidden_layers`). `HiddenRecorder`
is such a drafter: it drafts with another proposer (prompt lookup) and keeps the rows it is given.
So the training data costs no second pass over the text, and its features are exactly the ones a
head gets when serving (same dtype, same packed passes). Rows of the last pass of a request never
reach a drafter; a sequence is kept up to its last recorded row.

`AnswerRecorder` turns such a recording into training examples; `specserve train` (the data) and
bench/head_transfer.py (answers to Spec-Bench questions) both record through it. The engine that
decodes is the runtime's (cluster/engine), which this package never imports: the caller hands in a
`Decoder` that builds it around the recorder.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import torch

from speculators.heads.checkpoint import default_aux_layers
from speculators.proposers.base import DraftRequest, Proposer
from speculators.proposers.prompt_lookup import PromptLookupProposer
from speculators.train.dataset import Example
from speculators.tree import DraftTree

Decode = Callable[[list[tuple[str, list[int]]], int], list[list[int]]]
"""(request id, prompt ids) pairs and the longest answer -> each prompt's greedy answer (token ids),
in order."""
Decoder = Callable[[Proposer], Decode]
"""Builds a `Decode` around the drafter it is given: the target decodes with that drafter, which
must see every step's hidden rows (so the engine keeps drafting however few drafts are accepted)."""


def recorded_layers(num_layers: int) -> tuple[int, ...]:
    """What the data keeps: EAGLE-3's three default layers and the final output (EAGLE-1/2, Medusa)."""
    return (*default_aux_layers(num_layers), num_layers)


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


class AnswerRecorder:
    """The target's greedy answers with the hidden states of prompt and answer, as training examples.

    The target decodes with prompt lookup drafts (lossless, and faster) through a `HiddenRecorder`
    that keeps the rows every pass hands the drafter, so no second pass over the text is needed."""

    def __init__(self, layers: Sequence[int], decoder: Decoder, dtype: torch.dtype = torch.bfloat16):
        """`dtype`: how the rows are kept (see `HiddenRecorder`)."""
        self.recorder = HiddenRecorder(PromptLookupProposer(), layers, dtype)
        self.decode = decoder(self.recorder)

    def record(self, prompts: list[tuple[int, list[int], bool]], max_new_tokens: int) -> list[Example]:
        """(index, prompt ids, held out) -> one example per answered prompt."""
        request_ids = [uuid.uuid4().hex for _ in prompts]
        answers = self.decode([(request_id, ids) for request_id, (_, ids, _) in zip(request_ids, prompts)], max_new_tokens)
        examples = []
        for (index, ids, held_out), request_id, answer in zip(prompts, request_ids, answers):
            rows = self.recorder.collect(request_id)
            if rows is None:
                continue
            tokens = torch.tensor(ids + answer)[: rows.shape[0] + 1]
            examples.append(Example(index=index, tokens=tokens, hidden=rows, prompt_length=len(ids), held_out=held_out))
        return examples
