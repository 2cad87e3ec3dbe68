"""Sampling parameters and the logits -> probabilities warp shared by drafters and the verifier.

Both sides must warp identically: the verifier's lossless rule compares the target's warped
distribution p with the distribution q the drafter actually sampled from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from speculators import keyed

MIN_TEMPERATURE = 1e-5
"""Below this, logits / temperature overflows to infinity and the warped distribution is NaN."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    rule: str = "auto"
    """How sampled tokens are drawn. 'keyed': with noise keyed by (seed, position) (speculators.keyed),
    so the same seed gives the same tokens whatever was drafted; 'rejection': from a seeded random
    stream, by recursive rejection sampling, which accepts more of a sampled draft; 'auto' (what
    the service uses): keyed exactly when a seed is given."""

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.rule not in ("auto", "keyed", "rejection"):
            raise ValueError("rule must be 'auto', 'keyed' or 'rejection'")
        if self.rule == "keyed" and self.seed is None:
            raise ValueError("the keyed rule needs a seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def keyed(self) -> bool:
        """Sampled with noise keyed by (seed, position): the output does not depend on the drafts."""
        return not self.greedy and (self.rule == "keyed" or (self.rule == "auto" and self.seed is not None))

    @property
    def rejection(self) -> bool:
        """Sampled by rejection sampling, which needs the distribution each drafted token was drawn
        from (DraftTree.draft_probs). Keyed requests do not: their trees are cut and pruned freely."""
        return not self.greedy and not self.keyed

    def generator(self, salt: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
        """A random stream for this request, on `device`: torch draws only with a generator of the
        tensor's own device (a CUDA multinomial with a CPU generator raises), so it is made where
        the probabilities it samples from live."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed((self.seed * 1_000_003 + salt) % 2**63)  # torch seeds are 64-bit
        return generator


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (in that order, as transformers)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_scores.softmax(-1) >= params.top_p  # keep the token crossing top_p
        drop_sorted[..., 0] = False  # and always the likeliest (a top_p below float32's range rounds to 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


DRAFT_SALT = 1
"""Salts of the drafters' random streams start here (the verifier's is 0)."""


class DraftNoise:
    """The random numbers a drafter draws one request's tokens with in one step.

    A keyed request draws each drafted token with the target's own keyed noise at that token's
    position, so a drafted token is likely to be the very token the target samples there. Others
    draw from a stream salted by the request's length: a drafter restarted mid-request replays a
    position's numbers and never reuses one position's numbers at another."""

    def __init__(self, params: SamplingParams, length: int, device: torch.device | str = "cpu"):
        """`length`: the request's tokens so far, the root included."""
        self.params, self.length = params, length
        self.generator = None if params.greedy or params.keyed else params.generator(DRAFT_SALT + length, device)

    def draw(self, q: torch.Tensor, count: int, depth: int) -> torch.Tensor:
        """`count` tokens drawn from q [V] without replacement for tree depth `depth` (1: the root's
        children), as the exponential race: the largest q / E, E ~ Exp(1). It needs no host-side
        count of q's support: when q has fewer than `count` tokens the extra draws have q = 0. In
        float64, so that an E rounded to zero (which would always win) is out of reach."""
        if self.params.keyed:
            race = keyed.keyed_exponential(self.params.seed, self.length + depth - 1, q.shape[-1], q.device)
        else:
            race = torch.empty_like(q, dtype=torch.float64).exponential_(generator=self.generator)
        return torch.topk(q.double() / race, count).indices


def tree_draft_probs(rows: list[torch.Tensor]) -> torch.Tensor:
    """A rejection-sampled tree's `draft_probs` from the distributions its drafted nodes were drawn from (the
    root's row is zeros), on the CPU: the tree leaves the drafter's device."""
    return torch.stack([torch.zeros_like(rows[0]), *rows]).cpu()


def mapped_warp(draft_logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int,
                params: SamplingParams) -> torch.Tensor:
    """A head's sampling distribution over the target's vocabulary, from logits over its own
    (smaller) draft vocabulary whose token i is target token target_ids[i]; other tokens get 0."""
    full = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    full[..., target_ids] = draft_logits
    return warp(full, params)
