"""Checks a drafter's tree before the target sees it.

A drafter is untrusted in the sense that matters here: a tree with the wrong root, tokens outside the
vocabulary, more nodes than the cache has room for, or draft probabilities that are no distribution
would make the verifier raise (failing every request of the target group) or, worse, bias sampled
output. A bad tree costs only its own request's proposals for that step.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from speculators.tree import DraftTree

PROBABILITY_TOLERANCE = 1e-3


def tree_problem(tree: object, tokens: Sequence[int], vocab_size: int | None, max_nodes: int,
                 max_len: int) -> str | None:
    """What is wrong with `tree` as the draft of a request whose committed tokens are `tokens`, or None."""
    if not isinstance(tree, DraftTree):
        return f"a {type(tree).__name__}, not a DraftTree"
    try:  # a tree that crossed a process boundary was unpickled without its constructor's checks
        DraftTree(token_ids=tree.token_ids, parents=tree.parents, draft_probs=tree.draft_probs, confidence=tree.confidence,
                  extra_value=tree.extra_value)
    except Exception as error:
        return f"malformed ({error})"
    if tree.token_ids[0] != tokens[-1]:
        return f"root {tree.token_ids[0]!r} is not the last committed token {tokens[-1]}"
    if tree.num_drafted > max_nodes:
        return f"{tree.num_drafted} drafted nodes; at most {max_nodes}"
    if len(tokens) - 1 + tree.size > max_len:
        return f"{tree.size} nodes after {len(tokens)} tokens overflow the {max_len}-token cache"
    bad = [t for t in tree.token_ids if not isinstance(t, int) or (vocab_size is not None and not 0 <= t < vocab_size)]
    if bad:
        return f"token ids {bad[:3]} are outside the vocabulary"
    if tree.extra_value is not None and not all(0 <= value <= len(tokens) for value in tree.extra_value):
        return "extra_value must be a non-negative number of tokens"
    if tree.draft_probs is not None:
        return _probability_problem(tree, vocab_size)
    return None


def _probability_problem(tree: DraftTree, vocab_size: int | None) -> str | None:
    """Each drafted node's row must be a distribution that gives the node's own token a chance."""
    probs = tree.draft_probs
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or (vocab_size is not None and probs.shape[1] != vocab_size):
        return "draft_probs must be a [nodes, vocabulary] tensor"
    rows = probs[1:].double()
    if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
        return "draft_probs hold negative or non-finite values"
    if bool(((rows.sum(-1) - 1).abs() > PROBABILITY_TOLERANCE).any()):
        return "draft_probs rows do not sum to 1"
    drafted = torch.tensor(tree.token_ids[1:], dtype=torch.long)
    if bool((rows.gather(1, drafted[:, None]) <= 0).any()):
        return "a drafted token has draft probability 0 under its own row"
    return None
