"""Suffix decoding: draft what followed the text's longest matching suffix, in this request's own
text and in the outputs of earlier requests (the method of Arctic Inference and vLLM's `suffix`).

Two indexes answer the same question, "what followed the longest suffix of the context that
occurred before?":
- the request's own prompt and output so far: an n-gram index (prompt_lookup.NgramIndex),
  matched up to `max_match` tokens;
- a `SuffixTrie` over the outputs of earlier requests, shared by every request this proposer
  drafts for (a draft actor serves every target group of a replica and learns from all of them),
  bounded to `max_cached_tokens` tokens, oldest outputs evicted first.
Each gives a tree of its likeliest continuations, taken best first by frequency; the two are
merged into one tree (the planner keeps what pays). A draft's size adapts to the evidence: at
most `max_spec_factor` tokens per matched token, nodes down to `min_token_prob`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from speculators.proposers.base import DraftRequest, Proposer
from speculators.proposers.continuations import best_first_tree, merge_trees
from speculators.proposers.prompt_lookup import MAX_OCCURRENCES, NgramIndex
from speculators.tree import DraftTree


MAX_DEPTH, MAX_SPEC_FACTOR, MIN_TOKEN_PROB, MAX_CACHED_TOKENS = 24, 4.0, 0.1, 65536
"""Defaults (the serving defaults read them too): vLLM's tree depth and probability floor; a spec
factor of 4 measured best here once the planner trims what does not pay."""


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of up to `max_depth` tokens of the documents added (each suffix of
    each document inserted to that depth). Memory is bounded by evicting the oldest documents."""

    def __init__(self, max_depth: int, max_tokens: int):
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self.root = _Node()
        self._documents: deque[list[int]] = deque()
        self.tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        document = list(tokens)[-self.max_tokens:]
        if not document:
            return
        self._update(document, +1)
        self._documents.append(document)
        self.tokens += len(document)
        while self.tokens > self.max_tokens:
            oldest = self._documents.popleft()
            self._update(oldest, -1)
            self.tokens -= len(oldest)

    def _update(self, document: list[int], change: int) -> None:
        for start in range(len(document)):
            node = self.root
            for token in document[start:start + self.max_depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += change
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def match(self, context: Sequence[int]) -> tuple[_Node, int] | None:
        """The deepest node of the longest suffix of `context` that occurred with a continuation."""
        for length in range(min(self.max_depth - 1, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None


Children = dict[tuple[int, ...], list[tuple[int, int, tuple[int, ...]]]]


def _children(follows: list[list[int]]) -> Children:
    """Counted continuations of a request's own earlier occurrences: prefix -> [(token, count, child prefix)]."""
    counts: dict[tuple[int, ...], int] = {}
    for follow in follows:
        for depth in range(1, len(follow) + 1):
            prefix = tuple(follow[:depth])
            counts[prefix] = counts.get(prefix, 0) + 1
    children: Children = {}
    for prefix, count in counts.items():
        children.setdefault(prefix[:-1], []).append((prefix[-1], count, prefix))
    return children


class SuffixProposer(Proposer):
    name = "suffix"
    provides_probabilities = False

    def __init__(self, max_depth: int = MAX_DEPTH, max_match: int = 8, max_spec_factor: float = MAX_SPEC_FACTOR,
                 min_token_prob: float = MIN_TOKEN_PROB, max_cached_tokens: int = MAX_CACHED_TOKENS):
        if max_depth < 2 or max_match < 1 or max_spec_factor <= 0 or max_cached_tokens < 1:
            raise ValueError("suffix decoding needs max_depth >= 2, max_match >= 1, max_spec_factor > 0, "
                             "max_cached_tokens >= 1")
        self.max_match, self.max_spec_factor, self.min_token_prob = max_match, max_spec_factor, min_token_prob
        self.outputs = SuffixTrie(max_depth, max_cached_tokens)
        self._indexes: dict[str, NgramIndex] = {}

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._indexes.setdefault(request_id, NgramIndex(self.max_match)).sync(token_ids)

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def learn(self, output_ids: Sequence[int]) -> None:
        self.outputs.add(output_ids)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        return [self._propose(request) for request in requests]

    def _propose(self, request: DraftRequest) -> DraftTree:
        root = request.token_ids[-1]
        if request.num_speculative_tokens == 0 or request.max_nodes == 0:
            return DraftTree.root_only(root)
        self.on_accept(request.request_id, request.token_ids)
        found = [tree for tree in (self._from_own_text(request), self._from_outputs(request)) if tree is not None]
        return merge_trees(found, request.max_nodes) if found else DraftTree.root_only(root)

    def _tree(self, request: DraftRequest, root, total: int, expand, match_length: int) -> DraftTree:
        depth = min(request.num_speculative_tokens, max(1, int(self.max_spec_factor * match_length)))
        return best_first_tree(request.token_ids[-1], root, total, expand, match_length, request.max_nodes,
                               depth, self.min_token_prob, request.confidence_threshold)

    def _from_own_text(self, request: DraftRequest) -> DraftTree | None:
        index = self._indexes[request.request_id]
        tokens, total = index.tokens, len(index.tokens)
        for size in range(min(self.max_match, total - 1), 0, -1):
            earlier = [end for end in index.ends.get(tuple(tokens[total - size:]), []) if end < total]
            if earlier:
                # most recent first: among equally frequent continuations, the latest wins (prompt lookup's rule)
                follows = [tokens[end:end + request.num_speculative_tokens] for end in reversed(earlier[-MAX_OCCURRENCES:])]
                children = _children(follows)
                return self._tree(request, (), len(follows), lambda prefix: children.get(prefix, []), size)
        return None

    def _from_outputs(self, request: DraftRequest) -> DraftTree | None:
        matched = self.outputs.match(request.token_ids)
        if matched is None:
            return None
        node, length = matched

        def expand(state: _Node):
            return [(token, child.count, child) for token, child in state.children.items()]

        return self._tree(request, node, sum(c.count for c in node.children.values()), expand, length)
