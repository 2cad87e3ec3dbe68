"""Tree verification: which drafted tokens the target keeps, and the one token it adds.

Pure functions over a DraftTree and the target's logits at every tree node (row i = the target's
next-token logits after node i). Greedy keeps the longest path whose every token is the target's
argmax. The keyed rule (seeded requests, speculators.keyed) does the same with the token the
target samples at each position from noise keyed by the seed and the position: the output is the
target's own sample whatever was drafted. Otherwise sampling walks from the root with recursive
rejection sampling: child x of a node is accepted with probability min(1, p(x) / q(x)); on rejection
p becomes norm(max(p - q, 0)) and q loses x (siblings were drawn without replacement), and the next
sibling is tried; when every child fails, the token is drawn from what is left of p. At a leaf the
bonus token is drawn from p. The output distribution is exactly the target's (SpecInfer, EAGLE; Jeon
et al. 2024 for the without-replacement form).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from speculators.keyed import keyed_sample
from speculators.logprobs import TokenLogprob
from speculators.sampling import SamplingParams, warp
from speculators.tree import DraftTree


@dataclass
class VerifyResult:
    accepted_nodes: list[int]
    """Tree nodes kept, root first: the K/V to compact into place."""
    accepted_tokens: list[int]
    """The drafted tokens the target accepted (root excluded)."""
    next_token: int
    """The bonus token (after a fully accepted path) or the recovered token (after a rejection)."""
    hidden: torch.Tensor | None = None
    """The target's hidden states of `accepted_nodes`, [len(accepted_nodes), width] (as TargetHidden),
    when its drafter reads them (set by the target worker after the decision, on rank 0 only)."""
    logprobs: list[TokenLogprob] | None = None
    """Each new token's log-probability and top alternatives, when the request asked for them."""
    predictions: list[int] | None = None
    """The target's choice (argmax) after every node of the tree, for drafters that learn from the
    whole pass (set by the target worker when the item asks)."""

    @property
    def new_tokens(self) -> list[int]:
        return [*self.accepted_tokens, self.next_token]


def verify(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    position: int = 0,
) -> VerifyResult:
    """`target_logits` [tree.size, vocab]: row i the target's next-token logits after node i.
    `generator`: the request's random stream (the rejection rule); `position`: the index in the
    sequence of the token sampled after the root (the keyed rule)."""
    if target_logits.shape[0] != tree.size:
        raise ValueError(f"need target logits for all {tree.size} nodes, got {target_logits.shape[0]}")
    if params.greedy:
        return verify_greedy(tree, target_logits.argmax(-1).tolist())
    if params.keyed:
        return verify_keyed(tree, warp(target_logits, params), params.seed, position)
    return verify_sampled(tree, warp(target_logits, params), generator)


def _walk(tree: DraftTree, choice: Callable[[int, int], int]) -> VerifyResult:
    """Follow the children whose token is the target's own choice (`choice(node, depth)`) from the
    root; the first choice no child matches is the token the target adds."""
    node, path = 0, [0]
    while True:
        token = choice(node, len(path) - 1)
        match = next((kid for kid in tree.children[node] if tree.token_ids[kid] == token), None)
        if match is None:
            return VerifyResult(path, [tree.token_ids[n] for n in path[1:]], token)
        node = match
        path.append(node)


def verify_greedy(tree: DraftTree, best: Sequence[int]) -> VerifyResult:
    """Greedy verification needs only the target's choice at each node (`best[i]`: the argmax after
    node i), which a tensor-parallel target finds without gathering full-vocabulary rows."""
    return _walk(tree, lambda node, depth: best[node])


def verify_keyed(tree: DraftTree, target_probs: torch.Tensor, seed: int, position: int) -> VerifyResult:
    """`target_probs` [tree.size, vocab], warped as the request samples. A drafted token is kept
    exactly when it is the target's keyed sample at its position; the first sample no child matches
    is the recovered (or bonus) token. For a drafter without probabilities a token is kept with
    probability p(token), as under rejection sampling."""
    return _walk(tree, lambda node, depth: keyed_sample(target_probs[node], seed, position + depth))


def _normalized(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """weights / sum, or `fallback` when rounding left nothing (p and q equal up to float error)."""
    total = weights.sum()
    return weights / total if total > 0 else fallback


def _acceptance(p_token: float, q_token: float) -> float:
    if q_token <= 0:
        return 1.0 if p_token > 0 else 0.0
    return min(1.0, p_token / q_token)


def _residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """The target's distribution once `token` was rejected: norm(max(p - q, 0)), where q is the
    draft's distribution or, when None, a point mass on `token`."""
    if q is None:
        left = p.clone()
        left[token] = 0
    else:
        left = (p - q).clamp_min(0)
    return _normalized(left, p)


def _without(q: torch.Tensor, token: int) -> torch.Tensor:
    """The draft's distribution for the siblings still to try: drawn without replacement, none is `token`."""
    left = q.clone()
    left[token] = 0
    return _normalized(left, q)


def verify_sampled(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None
) -> VerifyResult:
    """`target_probs` [tree.size, vocab], warped as the request samples, may live on a GPU (then so
    must `generator`); the tree's draft probabilities arrive from a draft actor on the CPU and are
    moved next to them one visited row at a time."""
    target_probs = target_probs.double()
    device = target_probs.device
    node, path = 0, [0]
    while True:
        p = target_probs[node]
        kids = tree.children[node]
        q = None if tree.draft_probs is None or not kids else tree.draft_probs[kids[0]].to(device, torch.float64)
        accepted = None
        for kid in kids:
            token = tree.token_ids[kid]
            chance = _acceptance(float(p[token]), 1.0 if q is None else float(q[token]))
            if torch.rand((), generator=generator, dtype=torch.float64, device=device).item() < chance:
                accepted = kid
                break
            p = _residual(p, q, token)
            if q is not None:
                q = _without(q, token)
        if accepted is None:
            next_token = int(torch.multinomial(p.float(), 1, generator=generator))
            return VerifyResult(path, [tree.token_ids[n] for n in path[1:]], next_token)
        node = accepted
        path.append(node)
