"""Lookahead decoding (Fu et al. 2024): Jacobi iterations inside the verification pass grow a pool
of n-grams, and the pool's n-grams that start with the last token are drafted.

Per request a window of `window` columns, each a trajectory of up to `ngram - 1` tokens: column i's
first token guesses the token i + 1 places past the root, and each later token of the column the
place after the one before it, given the first tokens of columns 0..i and the column's own earlier
tokens. As a draft tree this is exactly Lookahead decoding's attention mask: the columns' first
tokens are a chain from the root (a Jacobi guess of the next tokens) and each column hangs from its
first token. The target's choice after each node (`DraftRequest.verified`, what the target worker
returns for drafters that read it) moves the window on: a column verified to its end gains the
target's next token; a column of `ngram` tokens is an n-gram of the pool (keyed by its first token)
and drops its oldest token, moving one place on as the root does. A step that commits k > 1 tokens
moves the window k - 1 columns further, new columns taking tokens of the context.

The verification branch is the pool's n-grams keyed by the root token (at most `candidates` of them,
most often generated first) as a trie with count-based confidences, as the other lookups draft.
The window's nodes are drafts too (the target accepts one now and then) and carry
`DraftTree.extra_value`: the pool tokens the target accepted per window node verified, learned as
the proposer runs. So the planner prices the window like any drafted token, its cost in the pass
against what it brings now and through the pool later, and drops it where passes are dear (the pool
then drafts from what it holds).

Drafts depend on the context and earlier passes' argmaxes alone, never on a step's random draws, so
sampled verification stays lossless (point-mass proposals, as for prompt lookup).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from speculators.proposers.base import DraftRequest, Proposer, VerifiedTree
from speculators.proposers.continuations import best_first_tree, counted_continuations
from speculators.proposers.suffix import MIN_TOKEN_PROB
from speculators.tree import DraftTree, token_paths

WINDOW, NGRAM, CANDIDATES = 4, 3, 4
"""Defaults: window columns (W), n-gram size (N) and n-grams verified a step (G), the best of four
settings on Spec-Bench in process (4/3/4 1.08x plain decoding; 8/3/8 1.01x, 12/3/8 0.99x, 4/4/4
1.02x: with N = 4 a column fills too slowly for its n-grams to pay before the planner drops the
window; docs/heads.md)."""
POOL_PER_KEY = 16
"""N-grams kept per first token (the least recently generated dropped first)."""
WINDOW_CONFIDENCE = 0.1
"""A window node's confidence: a Jacobi guess is seldom the target's token (the planner calibrates
it against what the target accepts)."""
PRIOR_NODES, PRIOR_YIELD = 64.0, 0.05
"""What the pool yields per window node before any is measured, as if seen over so many nodes: enough
for the window to run where a pass's tokens are cheap, so that its yield gets measured."""
DECAY = 0.995
"""Weight of the past in the yield estimate, per step (a few hundred steps of memory)."""
RETRY_AFTER = 64
"""Steps with no window node verified (the planner found the window not worth its tokens) after
which the yield estimate starts again from the prior: what a window yields grows as its pool fills,
and a load that made it too dear may have passed."""


@dataclass
class _Window:
    columns: list[list[int]]
    length: int
    """Committed tokens when the window was laid out (its root is the last of them)."""
    pool: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    """First token -> the tokens that followed it in generated n-grams -> times generated."""
    pool_paths: set[tuple[int, ...]] = field(default_factory=set)
    """Paths (from the root) of the last tree's nodes drafted from the pool."""


class LookaheadProposer(Proposer):
    name = "lookahead"
    provides_probabilities = False
    reads_verified = True

    def __init__(self, window: int = WINDOW, ngram: int = NGRAM, candidates: int = CANDIDATES):
        if window < 1 or ngram < 2 or candidates < 0:
            raise ValueError("lookahead decoding needs window >= 1, ngram >= 2 and candidates >= 0")
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self._windows: dict[str, _Window] = {}
        self._pool_accepted, self._window_nodes = PRIOR_YIELD * PRIOR_NODES, PRIOR_NODES
        self._steps_without_window = 0

    @property
    def pool_yield(self) -> float:
        """Pool tokens the target accepted per window node verified (what a window node is worth later)."""
        return self._pool_accepted / self._window_nodes

    def release(self, request_id: str) -> None:
        self._windows.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        return [self._propose(request) for request in requests]

    def _propose(self, request: DraftRequest) -> DraftTree:
        tokens = request.token_ids
        state = self._windows.get(request.request_id)
        if state is None:
            state = self._windows[request.request_id] = _Window([[_filler(tokens, i)] for i in range(self.window)], len(tokens))
        elif len(tokens) > state.length:
            self._advance(state, request.verified, tokens)
        if request.num_speculative_tokens == 0 or request.max_nodes == 0:
            state.pool_paths = set()
            return DraftTree.root_only(tokens[-1])
        return self._tree(state, request)

    def _tree(self, state: _Window, request: DraftRequest) -> DraftTree:
        """The pool's n-grams for the root, then the window, within the request's nodes and depth."""
        root, depth_cap, max_nodes = request.token_ids[-1], request.num_speculative_tokens, request.max_nodes
        found = sorted(state.pool.get(root, {}).items(), key=lambda item: -item[1])[:self.candidates]
        follows = [tail for tail, count in found for _ in range(count)]
        children = counted_continuations(follows)
        tree = best_first_tree(root, (), len(follows), lambda prefix: children.get(prefix, []), 1, max_nodes,
                               depth_cap, MIN_TOKEN_PROB, request.confidence_threshold)
        tokens, parents, confidence = list(tree.token_ids), list(tree.parents), list(tree.confidence)
        node_of = {path: node for node, path in enumerate(token_paths(tokens, parents))}
        state.pool_paths = set(node_of) - {()}
        extra = [0.0] * len(tokens)
        for path in self._window_paths(state):
            if path[:-1] not in node_of or len(path) > depth_cap:
                continue  # a parent left out (paths come parents first), or too deep
            if path not in node_of:
                if len(tokens) > max_nodes:
                    continue
                node_of[path] = len(tokens)
                tokens.append(path[-1])
                parents.append(node_of[path[:-1]])
                confidence.append(WINDOW_CONFIDENCE)
                extra.append(0.0)
            extra[node_of[path]] = self.pool_yield
        return DraftTree(tokens, parents, confidence=confidence, extra_value=extra)

    @staticmethod
    def _window_paths(state: _Window) -> list[tuple[int, ...]]:
        """Each window node's path from the root, parents first: the chain of first tokens, then each
        column below its first token."""
        chain, paths = (), []
        for column in state.columns:
            chain += (column[0],)
            paths.append(chain)
        for index, column in enumerate(state.columns):
            for end in range(2, len(column) + 1):
                paths.append(paths[index] + tuple(column[1:end]))
        return paths

    def _advance(self, state: _Window, verified: VerifiedTree | None, tokens: Sequence[int]) -> None:
        """The window after a verification: columns moved on by the target's choices, n-grams into the
        pool, the yield estimate updated, and the window shifted to the new root."""
        committed = len(tokens) - state.length
        if verified is not None:
            predicted = dict(zip(token_paths(verified.token_ids, verified.parents), verified.predictions))
            accepted = tokens[state.length:-1]  # drafted tokens the target kept (the last is its own)
            from_pool = sum(1 for end in range(1, len(accepted) + 1) if tuple(accepted[:end]) in state.pool_paths)
            window_nodes = sum(1 for path in self._window_paths(state) if path in predicted)
            self._learn_yield(from_pool, window_nodes)
            chain = ()
            for column in state.columns:
                chain += (column[0],)
                if chain not in predicted:
                    break  # the chain was cut here: this column and those after it were not verified
                seen = next(end for end in range(len(column), 0, -1) if chain + tuple(column[1:end]) in predicted)
                column[seen:] = [predicted[chain + tuple(column[1:seen])]]
                if len(column) == self.ngram:
                    self._pool(state, tuple(column))
                    del column[0]
        state.pool_paths = set()
        shift = min(committed - 1, self.window)
        state.columns = state.columns[shift:] + [[_filler(tokens, i)] for i in range(shift)]
        state.length = len(tokens)

    def _learn_yield(self, from_pool: int, window_nodes: int) -> None:
        self._pool_accepted = DECAY * self._pool_accepted + from_pool
        self._window_nodes = DECAY * self._window_nodes + window_nodes
        self._steps_without_window = 0 if window_nodes else self._steps_without_window + 1
        if self._steps_without_window >= RETRY_AFTER:
            self._pool_accepted, self._window_nodes = PRIOR_YIELD * PRIOR_NODES, PRIOR_NODES
            self._steps_without_window = 0

    @staticmethod
    def _pool(state: _Window, ngram: tuple[int, ...]) -> None:
        entries = state.pool.setdefault(ngram[0], {})
        entries[ngram[1:]] = entries.pop(ngram[1:], 0) + 1  # most recently generated last
        if len(entries) > POOL_PER_KEY:
            del entries[next(iter(entries))]


def _filler(tokens: Sequence[int], index: int) -> int:
    """A context token for a new window column, as Lookahead decoding seeds its window from the
    prompt: picked by the context's length and the column, so a request drafts the same way on any
    worker."""
    return tokens[(len(tokens) * 7919 + index * 104729) % len(tokens)]
