"""Does a sample of sequences follow a given distribution, and what shift could it have missed?

Two Pearson chi-square tests read the same counts. The sequence test compares the counts of whole
sequences with the exact joint distribution (rare cells pooled): it sees any difference, but its
many degrees of freedom dilute a difference confined to one conditional. So every conditional
P(x_t | x_<t) expected often enough is also tested on its own (Bonferroni over them). A case fails
when either test is significant at ALPHA / 2, or when any sample has probability 0 under the target.
The joint equals the target's exactly when every conditional does (the chain rule), so together
they test the sequence distribution, not a marginal. Pearson's statistic rather than the G-test's:
with many cells expected only a few times, G runs above its degrees of freedom and rejects too often.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2, power_divergence

from bench.lossless.target import SequenceDistribution

ALPHA = 1e-3
"""Per case. Samples are seeded, so a case passes or fails the same way on every run."""
POWER = 0.9
MIN_EXPECTED = 5.0
"""Cells expected fewer times are pooled (the chi-square approximation needs about 5)."""
MIN_CONDITIONAL_SAMPLES = 500
"""A prefix expected this often gets its own test of the next token."""


@dataclass
class GroupSample:
    """The sequences one group of requests produced, and the distribution they must follow."""

    counts: np.ndarray
    """Shape (V,) * L: how often each sequence of L new tokens came out."""
    exact: SequenceDistribution

    @property
    def samples(self) -> int:
        return int(self.counts.sum())

    def conditional_family(self) -> list[tuple[int, tuple[int, ...]]]:
        """(depth, prefix) of every conditional tested on its own: those with two or more possible
        tokens, expected often enough. Fixed by the expected counts, before looking at the sample."""
        family = []
        for depth in range(self.exact.new_tokens):
            expected = self.samples * self.exact.prefix_probabilities(depth)
            uncertain = (self.exact.conditionals[depth] > 0).sum(-1) >= 2
            tested = np.argwhere((expected >= MIN_CONDITIONAL_SAMPLES) & uncertain)
            family += [(depth, tuple(int(i) for i in prefix)) for prefix in tested]
        return family

    def next_token_counts(self, depth: int, prefix: tuple[int, ...]) -> np.ndarray:
        later = tuple(range(depth + 1, self.exact.new_tokens))
        return self.counts.sum(axis=later)[prefix]


@dataclass
class Verdict:
    samples: int
    statistic: float
    """Chi-square over whole sequences, all groups together."""
    df: int
    p_sequences: float
    p_conditionals: float
    """The smallest conditional p-value times the number of conditionals tested (at most 1)."""
    worst_conditional: str
    conditionals: int
    impossible: int
    """Samples the target gives probability 0 (outside top-k / top-p, or not the greedy token)."""
    p_value: float
    detectable_shift: float | None
    """Smallest mass moved between the two likeliest first tokens that this case detects with
    probability POWER (None when no group is sampled)."""
    detectable_shift_by_depth: list[float | None]
    """The same for the most likely prefix of each depth (fewer samples reach deeper prefixes)."""

    @property
    def passed(self) -> bool:
        return self.p_value > ALPHA


def pooled(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cells expected fewer than MIN_EXPECTED times merged into one, itself joined to the smallest
    other cell when it is still rare."""
    rare = expected < MIN_EXPECTED
    if not rare.any():
        return observed, expected
    observed = np.append(observed[~rare], observed[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    if expected[-1] < MIN_EXPECTED and len(expected) > 1:
        smallest = int(np.argmin(expected[:-1]))
        observed[smallest] += observed[-1]
        expected[smallest] += expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    return observed, expected


def chi_square(observed: np.ndarray, probabilities: np.ndarray) -> tuple[float, int]:
    """(X^2, degrees of freedom) of counts against probabilities > 0, rare cells pooled."""
    total = observed.sum()
    observed, expected = pooled(observed.astype(float), probabilities / probabilities.sum() * total)
    if len(observed) < 2:
        return 0.0, 0
    return float(power_divergence(observed, expected, lambda_="pearson").statistic), len(observed) - 1


def p_of(statistic: float, df: int) -> float:
    return float(chi2.sf(statistic, df)) if df else 1.0


def detectable_shift(samples: float, conditional: np.ndarray, tests: int) -> float | None:
    """Smallest mass moved between the two likeliest tokens of `conditional` that its own test,
    at ALPHA / tests, detects with probability POWER from `samples` draws.

    Under that shift X^2 is about noncentral chi-square with noncentrality
    samples * shift^2 * (1/p_a + 1/p_b) (the two cells are never pooled: they are the largest).
    """
    support = np.sort(conditional[conditional > 0])
    if len(support) < 2 or samples <= 0:
        return None
    df = len(pooled(support, support * samples)[1]) - 1
    critical = chi2.isf(ALPHA / tests, df)
    noncentrality = brentq(lambda lam: ncx2.sf(critical, df, lam) - POWER, 1e-9, 1e6)
    shift = float(np.sqrt(noncentrality / (samples * (1 / support[-1] + 1 / support[-2]))))
    return shift if shift <= support[-2] else None


def judge(groups: list[GroupSample]) -> Verdict:
    """The case's verdict over all its groups of requests."""
    statistic, df, impossible = 0.0, 0, 0
    conditional_p: list[tuple[float, str]] = []
    for index, group in enumerate(groups):
        joint = group.exact.joint
        impossible += int(group.counts[joint == 0].sum())
        x2, dof = chi_square(group.counts[joint > 0], joint[joint > 0])
        statistic, df = statistic + x2, df + dof
        for depth, prefix in group.conditional_family():
            conditional = group.exact.conditionals[depth][prefix]
            observed = group.next_token_counts(depth, prefix)
            conditional_p.append((p_of(*chi_square(observed[conditional > 0], conditional[conditional > 0])),
                                  f"group {index}, after {list(prefix)}"))
    tests = max(1, len(conditional_p))
    p_sequences = p_of(statistic, df)
    smallest, worst = min(conditional_p, default=(1.0, "none"))
    p_conditionals = min(1.0, smallest * tests)
    p_value = 0.0 if impossible else min(1.0, 2 * min(p_sequences, p_conditionals))
    by_depth = [_depth_shift(groups, depth, 2 * tests) for depth in range(max(g.exact.new_tokens for g in groups))]
    return Verdict(samples=sum(g.samples for g in groups), statistic=statistic, df=df, p_sequences=p_sequences,
                   p_conditionals=p_conditionals, worst_conditional=worst, conditionals=len(conditional_p),
                   impossible=impossible, p_value=p_value, detectable_shift=by_depth[0], detectable_shift_by_depth=by_depth)


def _depth_shift(groups: list[GroupSample], depth: int, tests: int) -> float | None:
    """The largest (worst) detectable shift over the groups, at the most likely prefix of `depth`
    whose next token is not certain."""
    shifts = []
    for group in groups:
        if depth >= group.exact.new_tokens:
            continue
        uncertain = (group.exact.conditionals[depth] > 0).sum(-1) >= 2
        reach = np.where(uncertain, group.exact.prefix_probabilities(depth), 0)
        prefix = np.unravel_index(np.argmax(reach), reach.shape)
        if group.samples * reach[prefix] >= MIN_CONDITIONAL_SAMPLES:  # tested on its own
            shifts.append(detectable_shift(group.samples * reach[prefix], group.exact.conditionals[depth][prefix], tests))
    known = [s for s in shifts if s is not None]
    return max(known) if known else None


def shifted_first_token(exact: SequenceDistribution, shift: float) -> SequenceDistribution:
    """The distribution with `shift` of first-token mass moved from the likeliest token to the
    second likeliest: judging a sample against it is judging a sampler off by that much."""
    first = exact.conditionals[0].copy()
    second, top = np.argsort(first)[-2:]
    first[top] -= shift
    first[second] += shift
    return SequenceDistribution([first, *exact.conditionals[1:]])
