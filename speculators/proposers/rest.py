"""REST (He et al. 2024, retrieval-based speculative decoding): draft what followed the context's
longest suffix in a corpus the operator supplies.

The corpus is a read-only datastore built offline (`specserve build-datastore`,
speculators/datastore.py): its suffix array finds the longest suffix of the context, up to
`max_match` tokens and at least `min_match`, that occurs in it; up to `max_occurrences` of the
occurrences' continuations are counted into a trie, and the tree is taken from it best first by
frequency, as suffix decoding takes its own (continuations.best_first_tree): a node's confidence is
its share of the occurrences reaching its parent, so the confidence lookahead and the planner treat
REST's drafts as they treat suffix decoding's.

Unlike suffix decoding's cache of earlier outputs, the datastore needs no per-tenant scoping: it is
the operator's corpus, the same for every tenant and never written by serving (this proposer does
not learn from outputs), so a draft reveals nothing of any request. Drafts are deterministic
(no drafter probabilities), which keeps sampled verification lossless as for the other lookups.
"""
from __future__ import annotations

from collections.abc import Sequence

from speculators.datastore import Datastore
from speculators.proposers.base import DraftRequest, Proposer
from speculators.proposers.continuations import best_first_tree, counted_continuations, draft_depth
from speculators.proposers.suffix import MAX_SPEC_FACTOR, MIN_TOKEN_PROB
from speculators.tree import DraftTree

MAX_MATCH, MIN_MATCH, MAX_OCCURRENCES = 16, 2, 256
"""Defaults: REST's longest suffix matched (16) and its cap on the continuations counted; a single
matched token says too little about what follows in a corpus of millions of tokens."""


class RestProposer(Proposer):
    name = "rest"
    provides_probabilities = False

    def __init__(self, datastore: Datastore, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH,
                 max_occurrences: int = MAX_OCCURRENCES, max_spec_factor: float = MAX_SPEC_FACTOR,
                 min_token_prob: float = MIN_TOKEN_PROB):
        if not 1 <= min_match <= max_match or max_occurrences < 1 or max_spec_factor <= 0:
            raise ValueError("REST needs 1 <= min_match <= max_match, max_occurrences >= 1 and max_spec_factor > 0")
        self.datastore = datastore
        self.max_match, self.min_match, self.max_occurrences = max_match, min_match, max_occurrences
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        return [self._retrieved(request) or DraftTree.root_only(request.token_ids[-1]) for request in requests]

    def _retrieved(self, request: DraftRequest) -> DraftTree | None:
        if request.num_speculative_tokens == 0 or request.max_nodes == 0:
            return None
        match = self.datastore.longest_match(request.token_ids[-self.max_match:], self.max_match, self.min_match)
        if match is None:
            return None
        lo, hi, length = match
        depth = draft_depth(request.num_speculative_tokens, length, self.max_spec_factor)
        follows = self.datastore.follows(lo, hi, length, depth, self.max_occurrences)
        if not follows:
            return None
        children = counted_continuations(follows)
        return best_first_tree(request.token_ids[-1], (), len(follows), lambda prefix: children.get(prefix, []),
                               length, request.max_nodes, depth, self.min_token_prob, request.confidence_threshold)
