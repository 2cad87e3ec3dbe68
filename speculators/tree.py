"""Draft trees: the shape every proposer produces and the verifier consumes.

Node 0 is the root: the last committed token, whose K/V the target has not computed yet. Every
other node is a drafted token whose parent has a smaller index, so index order is a topological
order. A chain is the tree whose parents are i - 1.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch


def extend_ancestors(
    mask: torch.Tensor, depths: Sequence[int], parents: Sequence[int]
) -> tuple[torch.Tensor, list[int]]:
    """Grow a tree's ancestor mask and depths by new nodes whose parents index the tree (-1 = none).

    `mask` [n, n] and `depths` [n] describe the nodes so far; returns the [n + m, n + m] mask and
    the m + n depths. One home for the rule, used for whole draft trees and for a model runner's
    scratch tree, which grows over several calls.
    """
    old, size = len(depths), len(depths) + len(parents)
    grown = torch.zeros(size, size, dtype=torch.bool)
    grown[:old, :old] = mask
    depths = list(depths)
    for index, parent in enumerate(parents, start=old):
        if not -1 <= parent < index:
            raise ValueError(f"node {index} has parent {parent}; parents must precede children")
        if parent >= 0:
            grown[index] = grown[parent]
        grown[index, index] = True
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return grown, depths


def ancestry(parents: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """(ancestor mask [N, N], depths [N]) of a whole tree: node i may attend to node j iff j is i or
    an ancestor of i."""
    return extend_ancestors(torch.zeros(0, 0, dtype=torch.bool), [], parents)


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    return ancestry(parents)[0]


def node_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (a root's is 0), in plain Python: the planner asks for it every step for
    every request, and torch calls there cost a GIL hand-over each in a serving process."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def token_paths(token_ids: Sequence[int], parents: Sequence[int]) -> list[tuple[int, ...]]:
    """The tokens from the root (excluded) down to each node (included), parents before children."""
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, len(token_ids)):
        paths.append(paths[parents[node]] + (token_ids[node],))
    return paths


def chain_parents(length: int, first_parent: int = -1) -> list[int]:
    return [first_parent] + list(range(first_parent + 1, first_parent + length)) if length else []


@dataclass
class DraftTree:
    """token_ids[N], parents[N]; draft_probs[i] is the drafter's distribution that node i was drawn
    from (its parent's next-token distribution, after the request's temperature / top-k / top-p),
    shared by siblings that were drawn without replacement in index order. None means the children
    were chosen deterministically (prompt lookup, greedy top-k) or that the request is keyed (its
    verifier keeps a token exactly when it is the target's own sample, speculators.keyed): the
    rejection rule then treats each child as a point-mass proposal, which keeps sampling lossless.
    `confidence[i]` is the drafter's own probability of node i (for stats and lookahead), or None
    when the drafter has none. `extra_value[i]`: output tokens node i is expected to bring beyond its
    own acceptance (a Lookahead decoding window node's share of what its n-grams yield later), which
    the planner adds to its worth; None: none.
    """

    token_ids: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None  # [N, vocab] (the root's row unused)
    confidence: list[float] | None = None
    extra_value: list[float] | None = None
    _children: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if len(self.token_ids) != len(self.parents) or not self.token_ids:
            raise ValueError("a draft tree needs as many parents as tokens, and at least the root")
        if self.parents[0] != -1:
            raise ValueError("node 0 is the root and has parent -1")
        for index, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < index:
                raise ValueError(f"node {index} has parent {parent}; parents must precede children")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids):
            raise ValueError("draft_probs needs one row per node")
        if self.extra_value is not None and len(self.extra_value) != len(self.token_ids):
            raise ValueError("extra_value needs one value per node")

    @classmethod
    def root_only(cls, root: int) -> "DraftTree":
        return cls([root], [-1])

    @classmethod
    def chain(cls, root: int, tokens: Sequence[int], draft_probs=None, confidence=None) -> "DraftTree":
        return cls(token_ids=[root, *tokens], parents=chain_parents(len(tokens) + 1), draft_probs=draft_probs,
                   confidence=confidence)

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]]) -> "DraftTree":
        """A deterministic tree (a trie) from token sequences that all continue the root."""
        tokens, parents, index = [root], [-1], {}
        for path in paths:
            node = 0
            for token in path:
                key = (node, token)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = index[key]
        return cls(tokens, parents)

    @property
    def size(self) -> int:
        return len(self.token_ids)

    @property
    def num_drafted(self) -> int:
        return len(self.token_ids) - 1

    @cached_property
    def depths(self) -> list[int]:
        return node_depths(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @cached_property
    def mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)

    @cached_property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.token_ids]
        for index, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(index)
        return kids

    @cached_property
    def paths(self) -> list[list[int]]:
        """Retrieve indices: every root-to-leaf path as node indices."""
        result, stack = [], [[0]]
        while stack:
            path = stack.pop()
            kids = self.children[path[-1]]
            if not kids:
                result.append(path)
            stack.extend(path + [kid] for kid in reversed(kids))
        return sorted(result)
