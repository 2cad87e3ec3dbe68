"""Drafting with Medusa heads over a static tree ("medusa choices").

The tree is a list of paths of ranks: [0] is head 1's most likely token, [0, 1] head 2's second most
likely token under it, [1] head 1's second choice, and so on; it is compiled once into parents
and ranks. Every step reads one row of the target's hidden state, the last committed token's
before the root, so the proposer keeps only that row per request.

Greedy requests take each node's ranked token (siblings are distinct ranks of one head); the
node's confidence is the head's probability of it. Sampled requests draw, for each drafted node,
as many children as the static tree gives it, without replacement from the head's distribution
(mapped from the draft vocabulary to the target's), and carry those distributions, so the
verifier's rejection sampling keeps the output lossless, which the original Medusa's typical
acceptance does not. The confidence rule ends a branch at a token below the request's threshold.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculators.heads.medusa import MedusaHeads
from speculators.proposers.base import DraftRequest, Proposer
from speculators.sampling import DraftNoise, mapped_warp, tree_draft_probs
from speculators.tree import DraftTree

DEFAULT_CHOICES = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [1, 0], [0, 0, 0, 0], [0, 0, 1], [3], [0, 2],
                   [2, 0], [1, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0, 0]]
"""A small tree for heads whose checkpoint names none: the likeliest ranks first, five deep."""


@dataclass(frozen=True)
class StaticTree:
    """A Medusa tree compiled from its paths: node 0 is the root; parents precede children."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depths: tuple[int, ...]

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> "StaticTree":
        paths = sorted({tuple(path) for path in choices if path}, key=lambda p: (len(p), p))
        index = {(): 0}
        parents, ranks, depths = [-1], [0], [0]
        for path in paths:
            if path[:-1] not in index:
                raise ValueError(f"medusa choice {list(path)} has no parent path {list(path[:-1])}")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
            depths.append(len(path))
        return cls(tuple(parents), tuple(ranks), tuple(depths))

    def children(self, node: int) -> list[int]:
        return [child for child, parent in enumerate(self.parents) if parent == node]


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
        return [self._draft(r, logits[r.request_id]) if r.request_id in logits else DraftTree.root_only(r.token_ids[-1])
                for r in requests]

    def _draft(self, request: DraftRequest, logits: torch.Tensor) -> DraftTree:
        """The static tree filled in from the heads' logits [num_heads, draft_vocab] of one request."""
        tree = self.tree
        greedy = request.sampling.greedy
        noise = DraftNoise(request.sampling, len(request.token_ids), logits.device)
        if greedy:
            top = torch.topk(logits.softmax(-1), max(tree.ranks) + 1, dim=-1)
            top_probs, top_tokens = top.values.tolist(), self.heads.token_map[top.indices].tolist()
        tokens, parents, confidence, rows = [request.token_ids[-1]], [-1], [1.0], [None]
        drafted = {0: 0}  # static node -> drafted node
        queue = [0]
        while queue:
            node = queue.pop(0)
            room = request.max_nodes - (len(tokens) - 1)
            children = [c for c in tree.children(node) if tree.depths[c] <= request.num_speculative_tokens][:max(0, room)]
            if not children or confidence[drafted[node]] < request.confidence_threshold:
                continue
            head = tree.depths[children[0]] - 1
            if greedy:
                picks = [(top_tokens[head][tree.ranks[c]], top_probs[head][tree.ranks[c]], None) for c in children]
            else:
                q = mapped_warp(logits[head], self.heads.token_map, self.heads.vocab_size, request.sampling)
                count = min(len(children), int((q > 0).sum()))
                picks = [(t, float(q[t]), q) for t in noise.draw(q, count, head + 1).tolist()]
            for child, (token, own, q_row) in zip(children, picks):
                drafted[child] = len(tokens)
                tokens.append(token)
                parents.append(drafted[node])
                confidence.append(own)
                rows.append(q_row)
                queue.append(child)
        draft_probs = None
        if request.sampling.rejection and len(tokens) > 1:
            draft_probs = tree_draft_probs(rows[1:])
        return DraftTree(token_ids=tokens, parents=parents, draft_probs=draft_probs, confidence=confidence)
