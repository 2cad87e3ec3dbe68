"""Sampled output through Ray: a tensor-parallel target (two shards, rank 0 verifies and broadcasts)
with its drafter in a draft actor, on fake GPUs; and the full set of `specserve bench lossless`
(slow), Ray cases included."""
from __future__ import annotations

from dataclasses import replace

import pytest

from bench.lossless.cases import CASES, CASES_BY_NAME
from bench.lossless.engines import FIXED_BUDGET
from bench.lossless.report import measure, sample_case
from bench.lossless.stats import judge
from tests.bench.lossless.fixtures import tiny_models  # noqa: F401  (session fixture)
from tests.cluster.ray_fixtures import ray_four_gpus  # noqa: F401  (module fixture)


def test_tp2_target_with_a_draft_actor_samples_the_targets_distribution(tiny_models, ray_four_gpus):
    """The planner off by configuration: on a cost curve measured at start it may draft next to
    nothing, and this test is about sampling through the actors (the full set runs it planned)."""
    case = CASES_BY_NAME["ray-tp2-layer-skip-tree"]
    unplanned = replace(case, engine={**case.engine, "step_token_budget": FIXED_BUDGET})
    groups, speculation = sample_case(unplanned, tiny_models, 2_000)
    verdict = judge(groups)
    assert verdict.passed and verdict.impossible == 0, verdict
    assert speculation["accepted"] > 200


@pytest.mark.slow
def test_the_full_set(tiny_models, ray_four_gpus):
    report = measure(CASES, tiny_models, scale=1.0, control_samples=10_000)
    failed = [c for c in report["cases"] if not c["passed"]]
    assert not failed, failed
    assert all(control["caught"] for control in report["negative_controls"]), report["negative_controls"]
    assert all(c["detectable_shift"] <= 0.01 for c in report["cases"] if c["core"])
