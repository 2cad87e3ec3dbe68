"""Draft trees from counted continuations: what followed earlier occurrences of the text's suffix.

Shared by the draftless proposers (prompt lookup, suffix decoding, REST). A continuation node's
confidence is the share of the occurrences reaching its parent that continue with its token,
shrunk less the longer the matched run is (the matched suffix plus the path down to the node):
a token that followed a 12-token run is a safer bet than one that followed a single token.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

from speculators.tree import DraftTree, token_paths

State = Any
"""Where a continuation stands in the proposer's own structure (a trie node, a prefix)."""
Expand = Callable[[State], Sequence[tuple[int, int, State]]]
"""A node's continuations: (token, count, child state); counts of one node's children sum to its total."""


def confidence(count: int, parent_total: int, run_length: int) -> float:
    """P(next token) estimate from counts: count / (parent total + 1 / run length)."""
    return count / (parent_total + 1.0 / run_length)


Children = dict[tuple[int, ...], list[tuple[int, int, tuple[int, ...]]]]
"""A trie of counted continuations as `best_first_tree` expands it: prefix -> [(token, count, child prefix)]."""


def counted_continuations(follows: Sequence[Sequence[int]]) -> Children:
    """The token runs that followed each occurrence of a match, counted into a trie (expand a node
    with `children.get(prefix, [])`, from the empty prefix; the root's total is len(follows))."""
    counts: dict[tuple[int, ...], int] = {}
    for follow in follows:
        for depth in range(1, len(follow) + 1):
            prefix = tuple(follow[:depth])
            counts[prefix] = counts.get(prefix, 0) + 1
    children: Children = {}
    for prefix, count in counts.items():
        children.setdefault(prefix[:-1], []).append((prefix[-1], count, prefix))
    return children


def draft_depth(num_speculative_tokens: int, match_length: int, max_spec_factor: float) -> int:
    """How deep a lookup drafts: within the lookahead, at most `max_spec_factor` tokens per matched
    token, so a longer match (stronger evidence) earns a deeper draft."""
    return min(num_speculative_tokens, max(1, int(max_spec_factor * match_length)))


def best_first_tree(root_token: int, root: State, total: int, expand: Expand, match_length: int,
                    max_nodes: int, max_depth: int, min_probability: float, threshold: float = 0.0) -> DraftTree:
    """The likeliest continuations as a tree: nodes taken in order of path probability (the
    product of confidences from the root) while it stays above `min_probability`, within
    `max_nodes` and `max_depth`; a branch ends after a node whose own confidence is below
    `threshold` (the confidence lookahead rule)."""
    tokens, parents, confidences = [root_token], [-1], [1.0]
    frontier: list[tuple[float, int, int, State, int]] = []  # (-path prob, order, parent index, state, depth)
    order = 0

    def push(parent: int, state: State, parent_total: int, depth: int, path: float) -> None:
        nonlocal order
        for token, count, child in expand(state):
            own = confidence(count, parent_total, match_length + depth)
            heapq.heappush(frontier, (-path * own, order, parent, (token, count, child, own), depth + 1))
            order += 1

    push(0, root, total, 0, 1.0)
    while frontier and len(tokens) <= max_nodes:
        negative, _, parent, (token, count, state, own), depth = heapq.heappop(frontier)
        if -negative < min_probability:
            break
        tokens.append(token)
        parents.append(parent)
        confidences.append(own)
        if depth < max_depth and own >= threshold:
            push(len(tokens) - 1, state, count, depth, -negative)
    return DraftTree(tokens, parents, confidence=confidences)


def merge_trees(trees: Sequence[DraftTree], max_nodes: int) -> DraftTree:
    """One tree holding the paths of several trees of the same root (a node found by more than one
    source keeps its highest confidence), cut to the `max_nodes` likeliest nodes by path
    probability; the planner then keeps what pays."""
    confidences: dict[tuple[int, ...], float] = {}
    for tree in trees:
        for node, path in enumerate(token_paths(tree.token_ids, tree.parents)[1:], start=1):
            confidences[path] = max(confidences.get(path, 0.0), tree.confidence[node])
    probability = {(): 1.0}
    for path in sorted(confidences, key=len):
        probability[path] = probability[path[:-1]] * confidences[path]
    kept = sorted(sorted(confidences, key=lambda p: (-probability[p], len(p)))[:max_nodes], key=len)
    tokens, parents, confidence, index = [trees[0].token_ids[0]], [-1], [1.0], {(): 0}
    for path in kept:
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
        confidence.append(confidences[path])
    return DraftTree(tokens, parents, confidence=confidence)
