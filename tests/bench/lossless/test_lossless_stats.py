"""The exact sequence distribution and the tests that judge samples against it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.lossless.cases import CASES, PROMPT
from bench.lossless.stats import GroupSample, judge, pooled, shifted_first_token
from speculators.sampling import SamplingParams, warp
from tests.bench.lossless.fixtures import tiny_models  # noqa: F401  (session fixture)

T1 = SamplingParams(1.0)


def draw(exact, samples: int, rng) -> np.ndarray:
    joint = exact.joint / exact.joint.sum()
    return rng.multinomial(samples, joint.ravel()).reshape(joint.shape)


@pytest.mark.parametrize("sampling", [T1, SamplingParams(0.7, top_k=5, top_p=0.9), SamplingParams()],
                         ids=["t1", "t0.7-k5-p0.9", "greedy"])
def test_conditionals_are_the_targets_own_step_by_step(tiny_models, sampling):
    """Every conditional read off the one batched forward equals a plain forward of that prefix."""
    exact = tiny_models.distribution(PROMPT, sampling, 4)
    assert exact.joint.sum() == pytest.approx(1.0, abs=1e-6)
    for prefix in [(), (3,), (3, 0), (11, 5, 7)]:
        with torch.no_grad():
            logits = tiny_models.reference(torch.tensor([PROMPT + prefix])).logits[0, -1]
        expected = warp(logits, sampling).double().numpy()
        np.testing.assert_allclose(exact.conditionals[len(prefix)][prefix], expected, atol=1e-7)


def test_samples_of_the_exact_distribution_pass(tiny_models):
    exact = tiny_models.distribution(PROMPT, T1, 4)
    rng = np.random.default_rng(0)
    verdicts = [judge([GroupSample(draw(exact, 20_000, rng), exact)]) for _ in range(5)]
    assert all(v.passed and v.impossible == 0 for v in verdicts), verdicts
    assert all(v.conditionals > 10 and v.df > 100 for v in verdicts)


def test_a_sequence_the_target_cannot_produce_fails(tiny_models):
    """Outside top-k (or off the greedy path) a single sample is proof of a bug."""
    exact = tiny_models.distribution(PROMPT, SamplingParams(1.0, top_k=3), 4)
    counts = draw(exact, 5_000, np.random.default_rng(1))
    assert judge([GroupSample(counts, exact)]).passed
    outside = np.unravel_index(np.argmin(exact.joint), exact.joint.shape)
    assert exact.joint[outside] == 0
    counts[outside] += 1
    verdict = judge([GroupSample(counts, exact)])
    assert not verdict.passed and verdict.impossible == 1


def test_the_detectable_shift_is_detected_nine_times_in_ten(tiny_models):
    """Power, by simulation: a sampler with `detectable_shift` of first-token mass moved between the
    two likeliest tokens is caught about 90% of the time; with a third of it, rarely."""
    exact = tiny_models.distribution(PROMPT, T1, 4)
    samples, rng = 20_000, np.random.default_rng(2)
    shift = judge([GroupSample(draw(exact, samples, rng), exact)]).detectable_shift
    assert 0.01 < shift < 0.03

    def caught(moved: float) -> float:
        wrong = shifted_first_token(exact, moved)
        return np.mean([not judge([GroupSample(draw(wrong, samples, rng), exact)]).passed for _ in range(100)])

    assert caught(shift) >= 0.8  # 0.9 expected; 100 draws
    assert caught(shift / 3) <= 0.2


def test_core_cases_are_sized_to_detect_a_one_percent_shift(tiny_models):
    """Power needs only the expected counts: checked here for the full run's sample sizes."""
    for case in (c for c in CASES if c.core):
        groups = []
        for group in case.groups:
            exact = tiny_models.distribution(group.prompt, group.sampling, group.new_tokens)
            groups.append(GroupSample(exact.joint * case.samples * group.share, exact))
        assert judge(groups).detectable_shift <= 0.01, case.name


def test_rare_cells_are_pooled_and_a_rare_pool_joins_the_smallest_cell():
    observed, expected = pooled(np.array([50, 40, 3, 1]), np.array([48.0, 42.0, 4.0, 2.0]))
    assert observed.tolist() == [50, 40, 4] and expected.tolist() == [48, 42, 6]
    observed, expected = pooled(np.array([50, 40, 3]), np.array([48.0, 42.0, 4.0]))
    assert observed.tolist() == [50, 43] and expected.tolist() == [48, 46]

