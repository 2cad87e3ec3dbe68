"""What one request asks of the target in one verification pass beyond its sampling warp.

Penalties and a grammar's allowed tokens change the target's distribution at every tree node, each
given the tokens on that node's path; the verifier then runs on the changed logits, so greedy output
is their argmax and sampled output follows them exactly. Log-probabilities are read from the raw
logits of the same pass. The engine builds one `Shaping` per request per step (it holds the grammar
matcher and the committed tokens); the target worker applies it on the rank that verifies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from speculators.penalties import PenaltyContext, penalize
from speculators.tree import DraftTree, token_paths

BITS = 32


@dataclass
class Shaping:
    penalties: PenaltyContext | None = None
    allowed: torch.Tensor | None = None
    """[tree size, ceil(V / 32)] int32: bit b of word w of row i set when token 32w + b may follow
    node i (the layout xgrammar and llguidance fill); None: every token."""
    logprobs: int | None = None
    """Alternatives wanted at each committed position (0: the chosen token's only); None: no logprobs."""

    def apply(self, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits at every node of `tree` as this request's rules change them."""
        if self.penalties is not None:
            logits = penalize(logits, self.penalties, path_tokens(tree))
        if self.allowed is not None:
            allowed = unpack_bits(self.allowed.to(logits.device), logits.shape[-1])
            if not bool(allowed.any(-1).all()):
                raise ValueError("the grammar allows no token after some node of the tree")
            logits = logits.masked_fill(~allowed, float("-inf"))
        return logits


def path_tokens(tree: DraftTree) -> list[list[int]]:
    """The drafted tokens from the root (excluded) down to each node (included)."""
    return [list(path) for path in token_paths(tree.token_ids, tree.parents)]


def unpack_bits(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bool [..., vocab] from int32 bitmask words [..., ceil(vocab / 32)]."""
    shifts = torch.arange(BITS, device=words.device, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab].bool()
