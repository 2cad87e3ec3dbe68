"""Drafting with Medusa heads over a static tree ("medusa choices", speculators/proposers/static_tree.py).

Every step reads one row of the target's hidden state, the last committed token's before the root,
so the proposer keeps only that row per request; head k's distribution fills depth k of the tree.
Sampled requests draw from the heads' distributions and carry them, so the verifier's rejection
sampling keeps the output lossless, which the original Medusa's typical acceptance does not.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from speculators.heads.medusa import MedusaHeads
from speculators.proposers.base import DraftRequest, Proposer
from speculators.proposers.static_tree import StaticTree, fill
from speculators.tree import DraftTree

DEFAULT_CHOICES = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [1, 0], [0, 0, 0, 0], [0, 0, 1], [3], [0, 2],
                   [2, 0], [1, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0, 0]]
"""A small tree for heads whose checkpoint names none: the likeliest ranks first, five deep."""


class MedusaProposer(Proposer):
    name = "medusa"
    provides_probabilities = True
    runs_a_model = True

    def __init__(self, heads: MedusaHeads, final_layer: int, choices: Sequence[Sequence[int]] | None = None):
        """`final_layer`: the target's layer count (its normed final output, what Medusa reads)."""
        self.heads = heads
        self.tree = StaticTree.from_choices(choices or DEFAULT_CHOICES)
        if max(self.tree.depths) > heads.num_heads:
            raise ValueError(f"the tree is {max(self.tree.depths)} deep but there are {heads.num_heads} heads")
        self.hidden_layers = (final_layer,)
        self.hidden_dtype = heads.blocks[0].layers[0].weight.dtype
        self._last: dict[str, tuple[int, torch.Tensor]] = {}
        """request id -> (position, the target's hidden state there) of its last committed row."""

    def release(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        ready = []
        for request in requests:
            if request.hidden is not None and request.hidden.states.shape[0]:
                self._last[request.request_id] = (request.hidden.end - 1, request.hidden.states[-1])
            last = self._last.get(request.request_id)
            if (last is not None and last[0] == len(request.token_ids) - 2
                    and request.num_speculative_tokens > 0 and request.max_nodes > 0):
                ready.append(request)
        logits = {}
        if ready:
            with torch.inference_mode():
                rows = torch.stack([self._last[r.request_id][1] for r in ready]).to(self.hidden_dtype)
                for index, row in enumerate(self.heads(rows).float().transpose(0, 1)):
                    logits[ready[index].request_id] = row
        heads = self.heads
        return [fill(self.tree, r, logits[r.request_id], heads.token_map, heads.vocab_size) if r.request_id in logits
                else DraftTree.root_only(r.token_ids[-1]) for r in requests]
