"""Suffix decoding: draft what followed the text's longest matching suffix, in this request's own
text and in the outputs of earlier requests (the method of Arctic Inference and vLLM's `suffix`).

Two indexes answer the same question, "what followed the longest suffix of the context that
occurred before?":
- the request's own prompt and output so far: an n-gram index (prompt_lookup.NgramIndex),
  matched up to `max_match` tokens;
- a `SuffixTrie` over the outputs of earlier requests of the same cache scope (`SuffixCache`; a
  draft actor serves every target group of a replica and learns from all of them, but a request
  drafts only from outputs learned under its own scope, so drafted counts reveal nothing of other
  tenants' outputs), bounded to `max_cached_tokens` tokens and `max_cached_bytes` bytes over all
  scopes, oldest outputs evicted first. The trie is path-compressed (on Spec-Bench text, a small
  fraction of the memory and learning time of a node per token position; bench/suffix_index.py,
  figures: docs/benchmarks.md, "Measurements behind the code"), and learns in short steps that a
  draft worker runs between its calls.
Each gives a tree of its likeliest continuations, taken best first by frequency; the two are
merged into one tree (the planner keeps what pays). A draft's size adapts to the evidence: at
most `max_spec_factor` tokens per matched token, nodes down to `min_token_prob`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

from speculators.proposers.base import DraftRequest, Proposer
from speculators.proposers.continuations import best_first_tree, counted_continuations, draft_depth, merge_trees
from speculators.proposers.prompt_lookup import MAX_OCCURRENCES, NgramIndex
from speculators.tree import DraftTree

MAX_DEPTH, MAX_SPEC_FACTOR, MIN_TOKEN_PROB, MAX_CACHED_TOKENS = 24, 4.0, 0.1, 65536
"""Defaults (the serving defaults read them too): vLLM's tree depth and probability floor; a spec
factor of 4 measured best here once the planner trims what does not pay."""
MAX_CACHED_BYTES = 64 << 20
"""Default memory bound of the learned outputs (all scopes together), as SuffixCache.bytes estimates
it: on Spec-Bench text (bench/suffix_index.py) the default token bound binds first; this one stops
text that shares less from costing more (figures: docs/benchmarks.md,
"Measurements behind the code")."""


LEARN_STEP_SUFFIXES = 16
"""Suffixes inserted (or removed) per step of learning in steps (`SuffixCache.adding`): a short
step of work, the longest a draft call waits for a background learner (actors/draft_worker.py)."""
NODE_BYTES, DICT_BYTES, LABEL_TOKEN_BYTES = 104, 360, 8
DOCUMENT_TOKEN_BYTES, ROOT_ENTRY_BYTES, TRIE_BYTES = 40, 72, 1024
"""Memory of the index by part, measured with tracemalloc (bench/suffix_index.py) and rounded up so
the estimate stays above what Python allocates: a node with its label tuple's header; a children
dict below the root (a few entries); a label token (a pointer); a kept document's token (a pointer
and its int object); a slot of a root's children (a dict that never shrinks by itself); a scope's
trie."""


class _Node:
    """A run of trie positions with one count (a path-compressed trie): `label` holds the tokens from
    the parent's end to this node's end, so a run seen once costs one node, not one per token.
    `count`: how many inserted suffixes pass through every position of the run."""

    __slots__ = ("label", "count", "children")

    def __init__(self, label: tuple[int, ...], count: int, children: dict[int, _Node] | None = None):
        self.label, self.count, self.children = label, count, children


Position = tuple[_Node, int]
"""A place in the trie: a node and how many tokens of its label lie before it (the root: 0)."""


class _Size:
    """Parts of every trie of a SuffixCache, counted as they change (the memory estimate's input)."""

    __slots__ = ("nodes", "dicts", "label_tokens", "root_slots")

    def __init__(self):
        self.nodes = self.dicts = self.label_tokens = self.root_slots = 0


class SuffixTrie:
    """Counts of every substring of up to `max_depth` tokens of the documents added (each suffix of
    each document inserted to that depth), path-compressed: runs of single-child positions with one
    count are one node. Documents are added and removed whole, in steps (`update`); a SuffixCache
    decides which documents to keep."""

    def __init__(self, max_depth: int, size: _Size | None = None):
        self.max_depth = max_depth
        self.root = _Node((), 0, {})
        self.size = size or _Size()
        self.root_slots = 0
        """The most children the root's dict has held since it was last rebuilt (what it costs)."""

    @property
    def empty(self) -> bool:
        return not self.root.children

    def add(self, document: Sequence[int]) -> None:
        for _ in self.update(tuple(document), +1):
            pass

    def remove(self, document: Sequence[int]) -> None:
        """Forget a document added before (its every suffix)."""
        for _ in self.update(tuple(document), -1):
            pass

    def update(self, document: tuple[int, ...], change: int) -> Iterator[None]:
        """Insert (change +1) or remove (-1) the document's suffixes, yielding between steps of
        LEARN_STEP_SUFFIXES: the trie is consistent at every yield (a suffix is in or out whole)."""
        edit = self._insert if change > 0 else self._remove
        for start in range(len(document)):
            edit(document[start:start + self.max_depth])
            if start % LEARN_STEP_SUFFIXES == LEARN_STEP_SUFFIXES - 1:
                yield

    def _split(self, node: _Node, at: int) -> None:
        """Cut a node's run after `at` tokens; the node keeps its place in its parent's children."""
        rest = _Node(node.label[at:], node.count, node.children)
        node.label, node.children = node.label[:at], {rest.label[0]: rest}
        self.size.nodes += 1
        self.size.dicts += 1

    def _insert(self, suffix: tuple[int, ...]) -> None:
        node, i, end = self.root, 0, len(suffix)
        while i < end:
            children = node.children
            child = None if children is None else children.get(suffix[i])
            if child is None:
                if children is None:
                    children = node.children = {}
                    self.size.dicts += 1
                children[suffix[i]] = _Node(suffix[i:], 1)
                self.size.nodes += 1
                self.size.label_tokens += end - i
                if node is self.root and len(children) > self.root_slots:
                    self.root_slots += 1
                    self.size.root_slots += 1
                return
            label = child.label
            matched, most = 1, min(len(label), end - i)
            while matched < most and label[matched] == suffix[i + matched]:
                matched += 1
            if matched < len(label):
                self._split(child, matched)
            child.count += 1
            node, i = child, i + matched

    def _remove(self, suffix: tuple[int, ...]) -> None:
        node, i, end = self.root, 0, len(suffix)
        while i < end:
            child = node.children[suffix[i]]
            matched = min(len(child.label), end - i)
            if matched < len(child.label):
                self._split(child, matched)
            child.count -= 1
            if child.count == 0:
                del node.children[suffix[i]]
                self._forget(child)
                if node is self.root:
                    self._shrink_root()
                elif not node.children:
                    node.children = None
                    self.size.dicts -= 1
                break
            node, i = child, i + matched
        self._merge(node)

    def _shrink_root(self) -> None:
        """Rebuild the root's dict once most of its slots are empty (a copy keeps the order)."""
        children = self.root.children
        if 4 * len(children) < self.root_slots:
            self.root.children = dict(children)
            self.size.root_slots -= self.root_slots - len(children)
            self.root_slots = len(children)

    def _forget(self, node: _Node) -> None:
        """Count out a subtree that was cut off."""
        stack = [node]
        while stack:
            node = stack.pop()
            self.size.nodes -= 1
            self.size.label_tokens -= len(node.label)
            if node.children is not None:
                self.size.dicts -= 1
                stack.extend(node.children.values())

    def _merge(self, node: _Node) -> None:
        """Join a node with its only child when they count the same again (after a removal)."""
        if node is self.root or node.children is None or len(node.children) != 1:
            return
        (only,) = node.children.values()
        if only.count == node.count:
            node.label += only.label
            node.children = only.children
            self.size.nodes -= 1
            self.size.dicts -= 1

    def _walk(self, tokens: Sequence[int]) -> Position | None:
        node, offset = self.root, 0
        for token in tokens:
            if offset < len(node.label):
                if node.label[offset] != token:
                    return None
                offset += 1
            else:
                node = None if node.children is None else node.children.get(token)
                if node is None:
                    return None
                offset = 1
        return node, offset

    def match(self, context: Sequence[int]) -> tuple[Position, int] | None:
        """Where the longest suffix of `context` that occurred with a continuation ends, and its length."""
        for length in range(min(self.max_depth - 1, len(context)), 0, -1):
            position = self._walk(context[len(context) - length:])
            if position is not None and continuations(position):
                return position, length
        return None


def continuations(position: Position) -> list[tuple[int, int, Position]]:
    """What followed a position: (token, count, next position), in the order first seen."""
    node, offset = position
    if offset < len(node.label):
        return [(node.label[offset], node.count, (node, offset + 1))]
    return [(token, child.count, (child, 1)) for token, child in (node.children or {}).items()]


class SuffixCache:
    """Earlier outputs, one SuffixTrie per cache scope (a request drafts only from outputs learned
    under its own scope), all of them under one bound in tokens and one in bytes: the oldest
    documents of any scope go first. The bounds hold once a document is learned; while one is being
    learned they may be exceeded by that document's share."""

    def __init__(self, max_depth: int, max_tokens: int, max_bytes: int | None = None):
        self.max_depth, self.max_tokens, self.max_bytes = max_depth, max_tokens, max_bytes
        self.tries: dict[str, SuffixTrie] = {}
        self._documents: deque[tuple[str, tuple[int, ...]]] = deque()
        self._size = _Size()
        self.tokens = 0

    @property
    def bytes(self) -> int:
        """Estimated memory of the tries and the kept documents (NODE_BYTES and the others)."""
        size = self._size
        return (size.nodes * NODE_BYTES + size.dicts * DICT_BYTES + size.label_tokens * LABEL_TOKEN_BYTES
                + size.root_slots * ROOT_ENTRY_BYTES + len(self.tries) * TRIE_BYTES
                + self.tokens * DOCUMENT_TOKEN_BYTES)

    def _over(self) -> bool:
        return self.tokens > self.max_tokens or (self.max_bytes is not None and self.bytes > self.max_bytes)

    def add(self, tokens: Sequence[int], scope: str = "") -> None:
        for _ in self.adding(tokens, scope):
            pass

    def adding(self, tokens: Sequence[int], scope: str = "") -> Iterator[None]:
        """Learn a document under `scope` (its last max_tokens tokens), then evict the oldest
        documents while over a bound, in steps (see SuffixTrie.update)."""
        document = tuple(tokens)[-self.max_tokens:]
        if not document:
            return
        trie = self.tries.get(scope)
        if trie is None:
            trie = self.tries[scope] = SuffixTrie(self.max_depth, self._size)
        self._documents.append((scope, document))
        self.tokens += len(document)
        yield from trie.update(document, +1)
        while self._documents and self._over():
            scope, oldest = self._documents.popleft()
            self.tokens -= len(oldest)
            trie = self.tries[scope]
            yield from trie.update(oldest, -1)
            if trie.empty:
                del self.tries[scope]
                self._size.root_slots -= trie.root_slots

    def match(self, context: Sequence[int], scope: str = "") -> tuple[Position, int] | None:
        trie = self.tries.get(scope)
        return None if trie is None else trie.match(context)


class SuffixProposer(Proposer):
    name = "suffix"
    provides_probabilities = False

    def __init__(self, max_depth: int = MAX_DEPTH, max_match: int = 8, max_spec_factor: float = MAX_SPEC_FACTOR,
                 min_token_prob: float = MIN_TOKEN_PROB, max_cached_tokens: int = MAX_CACHED_TOKENS,
                 max_cached_bytes: int | None = MAX_CACHED_BYTES):
        if max_depth < 2 or max_match < 1 or max_spec_factor <= 0 or max_cached_tokens < 1 \
                or (max_cached_bytes is not None and max_cached_bytes < 1):
            raise ValueError("suffix decoding needs max_depth >= 2, max_match >= 1, max_spec_factor > 0, "
                             "max_cached_tokens >= 1, max_cached_bytes >= 1")
        self.max_match, self.max_spec_factor, self.min_token_prob = max_match, max_spec_factor, min_token_prob
        self.outputs = SuffixCache(max_depth, max_cached_tokens, max_cached_bytes)
        self._indexes: dict[str, NgramIndex] = {}

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._indexes.setdefault(request_id, NgramIndex(self.max_match)).sync(token_ids)

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def learn(self, output_ids: Sequence[int], scope: str | None = "") -> None:
        for _ in self.learn_steps(output_ids, scope):
            pass

    def learn_steps(self, output_ids: Sequence[int], scope: str | None = "") -> Iterator[None]:
        if scope is not None:
            yield from self.outputs.adding(output_ids, scope)

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
        depth = draft_depth(request.num_speculative_tokens, match_length, self.max_spec_factor)
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
                children = counted_continuations(follows)
                return self._tree(request, (), len(follows), lambda prefix: children.get(prefix, []), size)
        return None

    def _from_outputs(self, request: DraftRequest) -> DraftTree | None:
        if request.cache_scope is None:  # a request that shares nothing drafts from its own text alone
            return None
        matched = self.outputs.match(request.token_ids, request.cache_scope)
        if matched is None:
            return None
        position, length = matched
        return self._tree(request, position, sum(count for _, count, _ in continuations(position)), continuations,
                          length)
