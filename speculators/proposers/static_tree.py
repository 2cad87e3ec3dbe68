"""A static tree of ranks filled in from per-position distributions (Medusa heads, DFlash blocks).

Drafters that predict every depth at once, independently of what is drafted above it, draft over a
tree fixed in advance: a list of paths of ranks, where [0] is depth 1's most likely token, [0, 1]
depth 2's second most likely token under it, [1] depth 1's second choice, and so on ("medusa
choices"); it is compiled once into parents and ranks.

Greedy requests take each node's ranked token (siblings are distinct ranks of one depth); the
node's confidence is the drafter's probability of it. Sampled requests draw, for each drafted
node, as many children as the static tree gives it, without replacement from that depth's
distribution (mapped from the draft vocabulary to the target's), and carry those distributions, so
the verifier's rejection sampling keeps the output lossless. The confidence rule ends a branch at a
token below the request's threshold.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculators.proposers.base import DraftRequest
from speculators.sampling import DraftNoise, mapped_warp, tree_draft_probs
from speculators.tree import DraftTree


@dataclass(frozen=True)
class StaticTree:
    """A tree compiled from its rank paths: node 0 is the root; parents precede children."""

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
                raise ValueError(f"tree path {list(path)} has no parent path {list(path[:-1])}")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
            depths.append(len(path))
        return cls(tuple(parents), tuple(ranks), tuple(depths))

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self, node: int) -> list[int]:
        return [child for child, parent in enumerate(self.parents) if parent == node]


def chain_choices(depth: int) -> list[list[int]]:
    """A chain of each depth's likeliest token."""
    return [[0] * d for d in range(1, depth + 1)]


def fill(tree: StaticTree, request: DraftRequest, logits: torch.Tensor, token_map: torch.Tensor,
         vocab_size: int) -> DraftTree:
    """The static tree filled in from logits [depths, draft_vocab] of one request (row d - 1 scores
    depth d); `token_map`: target token id of each draft token id."""
    greedy = request.sampling.greedy
    noise = DraftNoise(request.sampling, len(request.token_ids), logits.device)
    if greedy:
        top = torch.topk(logits.softmax(-1), max(tree.ranks) + 1, dim=-1)
        top_probs, top_tokens = top.values.tolist(), token_map[top.indices].tolist()
    tokens, parents, confidence, rows = [request.token_ids[-1]], [-1], [1.0], [None]
    drafted = {0: 0}  # static node -> drafted node
    queue = [0]
    while queue:
        node = queue.pop(0)
        room = request.max_nodes - (len(tokens) - 1)
        children = [c for c in tree.children(node) if tree.depths[c] <= min(request.num_speculative_tokens, len(logits))]
        children = children[:max(0, room)]
        if not children or confidence[drafted[node]] < request.confidence_threshold:
            continue
        row = tree.depths[children[0]] - 1
        if greedy:
            picks = [(top_tokens[row][tree.ranks[c]], top_probs[row][tree.ranks[c]], None) for c in children]
        else:
            q = mapped_warp(logits[row], token_map, vocab_size, request.sampling)
            count = min(len(children), int((q > 0).sum()))
            picks = [(t, float(q[t]), q) for t in noise.draw(q, count, row + 1).tolist()]
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
