"""Prompt lookup decoding: continue the text by copying what followed the same n-gram earlier.

`num_tokens` and `max_ngram_size` are transformers' `prompt_lookup_num_tokens` and
`max_matching_ngram_size` (llama-cpp-python's `num_pred_tokens` and `max_ngram_size`). Beyond them,
`max_branches` > 1 turns several earlier matches into the branches of one tree, so the target
checks all of them in the same pass.

Each request keeps an index of where every n-gram ended, updated with the tokens committed since
the last step, so a lookup costs the same at 100 tokens of context as at 4,000. Every drafted node
gets a confidence from the proposer's own statistics: of the earlier occurrences that agree with
the path so far, the share that continue with this token, shrunk less the longer the matched run
(the n-gram plus the path) is. The scheduler calibrates it against what the target accepts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from speculators.proposers.base import DraftRequest, Proposer
from speculators.proposers.continuations import confidence
from speculators.tree import DraftTree

NUM_TOKENS, MAX_NGRAM_SIZE, MAX_BRANCHES = 20, 2, 2
"""Defaults, chosen on Spec-Bench questions with the planner trimming every tree (the serving
defaults read them too)."""
MAX_OCCURRENCES = 64
"""Earlier occurrences of the matched n-gram counted for confidences (the most recent ones)."""


@dataclass
class NgramIndex:
    """Where each n-gram of a growing token sequence ended (exclusive end positions, ascending)."""

    max_n: int
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def sync(self, token_ids: Sequence[int]) -> None:
        """Catch up with the committed tokens (rebuilt when they do not extend what is indexed)."""
        known = len(self.tokens)
        if len(token_ids) < known or list(token_ids[:known]) != self.tokens:
            self.tokens, self.ends, known = [], {}, 0
        for token in token_ids[known:]:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n:end]), []).append(end)


@dataclass
class Lookup:
    paths: list[list[int]]
    """Distinct continuations, most recent occurrence first."""
    confidence: dict[tuple[int, ...], float]
    """Confidence of the node reached by each path prefix."""


def lookup(index: NgramIndex, length: int, max_branches: int) -> Lookup:
    """Continuations of the longest n-gram suffix that occurs earlier."""
    tokens, total = index.tokens, len(index.tokens)
    for size in range(min(index.max_n, total - 1), 0, -1):
        earlier = [end for end in index.ends.get(tuple(tokens[total - size:]), []) if end < total]
        if not earlier:
            continue
        follows = [tokens[end:end + length] for end in reversed(earlier[-MAX_OCCURRENCES:])]
        paths: list[list[int]] = []
        for follow in follows:
            if len(paths) < max_branches and not any(other[:len(follow)] == follow for other in paths):
                paths.append(follow)
        return Lookup(paths, _confidences(follows, size))
    return Lookup([], {})


def _confidences(follows: list[list[int]], size: int) -> dict[tuple[int, ...], float]:
    counts: dict[tuple[int, ...], int] = {(): len(follows)}
    for follow in follows:
        for depth in range(1, len(follow) + 1):
            prefix = tuple(follow[:depth])
            counts[prefix] = counts.get(prefix, 0) + 1
    return {prefix: confidence(count, counts[prefix[:-1]], size + len(prefix) - 1)
            for prefix, count in counts.items() if prefix}


class PromptLookupProposer(Proposer):
    name = "pld"
    provides_probabilities = False

    def __init__(self, num_tokens: int = NUM_TOKENS, max_ngram_size: int = MAX_NGRAM_SIZE, max_branches: int = MAX_BRANCHES):
        if num_tokens < 1 or max_ngram_size < 1 or max_branches < 1:
            raise ValueError("num_tokens, max_ngram_size and max_branches must be >= 1")
        self.num_tokens, self.max_ngram_size, self.max_branches = num_tokens, max_ngram_size, max_branches
        self._indexes: dict[str, NgramIndex] = {}

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._indexes.setdefault(request_id, NgramIndex(self.max_ngram_size)).sync(token_ids)

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        return [self._propose(request) for request in requests]

    def _propose(self, request: DraftRequest) -> DraftTree:
        root = request.token_ids[-1]
        depth = min(self.num_tokens, request.num_speculative_tokens)
        if depth == 0 or request.max_nodes == 0:
            return DraftTree.root_only(root)
        self.on_accept(request.request_id, request.token_ids)
        found = lookup(self._indexes[request.request_id], depth, self.max_branches)
        tokens, parents, confidences, node_of = [root], [-1], [1.0], {(): 0}
        for path in found.paths:
            for depth_index in range(1, len(path) + 1):
                prefix = tuple(path[:depth_index])
                if prefix in node_of:
                    continue
                parent = node_of[prefix[:-1]]
                if len(tokens) > request.max_nodes or confidences[parent] < request.confidence_threshold:
                    break
                node_of[prefix] = len(tokens)
                tokens.append(prefix[-1])
                parents.append(parent)
                confidences.append(found.confidence[prefix])
        return DraftTree(tokens, parents, confidence=confidences)
