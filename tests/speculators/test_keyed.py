"""Keyed sampling (speculators.keyed): the noise is a fixed function of (seed, position), its samples
follow the distribution, and the verifier keeps exactly the drafted tokens that are its own samples."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from speculators.keyed import _mix, _mix_scalar, keyed_sample, keyed_uniform
from speculators.sampling import DraftNoise, SamplingParams
from speculators.tree import DraftTree
from speculators.verify import verify

P = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0], dtype=torch.float64)


def test_the_tensor_hash_is_the_32_bit_hash_without_overflow():
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0x12345678, 0xDEADBEEF]
    assert _mix(torch.tensor(values)).tolist() == [_mix_scalar(v) for v in values]


def test_uniforms_are_open_interval_and_a_function_of_seed_and_position():
    u = keyed_uniform(7, 11, 100_000)
    assert bool((u > 0).all() and (u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert torch.equal(u, keyed_uniform(7, 11, 100_000))
    assert not torch.equal(u, keyed_uniform(7, 12, 100_000)) and not torch.equal(u, keyed_uniform(8, 11, 100_000))
    assert torch.equal(keyed_uniform(2**64 - 1, 3, 10), keyed_uniform(-1, 3, 10))  # seeds are taken mod 2^64


@pytest.mark.parametrize("across", ["seeds", "positions"])
def test_samples_follow_the_distribution(across):
    draws = [keyed_sample(P, seed, 5) for seed in range(20_000)] if across == "seeds" else \
        [keyed_sample(P, 3, position) for position in range(20_000)]
    counts = np.bincount(draws, minlength=len(P))
    assert counts[-1] == 0  # probability 0 is never drawn
    assert chisquare(counts[:-1], P[:-1].numpy() * len(draws)).pvalue > 1e-3


def test_neighbouring_positions_are_independent():
    """The pair (token at position 9, token at 10) over 20,000 seeds: counts against the product."""
    pairs = np.zeros((len(P), len(P)))
    for seed in range(20_000):
        pairs[keyed_sample(P, seed, 9), keyed_sample(P, seed, 10)] += 1
    expected = np.outer(P.numpy(), P.numpy()) * 20_000
    keep = expected > 0
    assert chisquare(pairs[keep], expected[keep]).pvalue > 1e-3


def test_a_row_that_is_no_distribution_raises():
    with pytest.raises(ValueError, match="no token"):
        keyed_sample(torch.zeros(4), 1, 1)
    with pytest.raises(ValueError, match="no token"):
        keyed_sample(torch.full((4,), float("nan")), 1, 1)


def test_a_drafter_drawing_from_the_targets_distribution_drafts_the_targets_sample():
    """With q = p the draft's first token at depth d is the token the target samples at that position."""
    params = SamplingParams(1.0, seed=42)
    length = 17  # tokens so far, the root included: depth 1 is position 17
    for depth in (1, 2, 3):
        drawn = DraftNoise(params, length).draw(P, 3, depth)
        assert int(drawn[0]) == keyed_sample(P, 42, length + depth - 1)
        assert len(set(drawn.tolist())) == 3


def test_the_verifier_keeps_the_drafted_tokens_that_are_its_own_samples():
    params = SamplingParams(1.0, seed=5)
    logits = P.log().expand(4, -1).clone()  # the same distribution at every node
    samples = [keyed_sample(P, 5, 30 + depth) for depth in range(4)]
    wrong = next(t for t in range(5) if t not in samples[:2])
    chain = DraftTree.chain(0, [samples[0], wrong, samples[2]])
    result = verify(chain, logits, params, position=30)
    assert result.new_tokens == samples[:2]  # kept the first, replaced the second by the sample
    tree = DraftTree([0, wrong, samples[0], samples[1]], [-1, 0, 0, 2])  # the sample is the second child
    assert verify(tree, logits, params, position=30).new_tokens == samples[:3]


def test_the_keyed_rule_needs_a_seed_and_the_auto_rule_follows_it():
    with pytest.raises(ValueError, match="needs a seed"):
        SamplingParams(1.0, rule="keyed")
    assert SamplingParams(1.0, seed=1).keyed and not SamplingParams(1.0).keyed
    assert not SamplingParams(1.0, seed=1, rule="rejection").keyed and not SamplingParams(0.0, seed=1).keyed
    assert SamplingParams(1.0).rejection and not SamplingParams(1.0, seed=1).rejection
