"""The fast subset of `specserve bench lossless`: a few cases through the real in-process engine,
and every negative control caught. The full set (tens of thousands of samples a case, Ray cases
included) is the command itself, and a slow test in test_lossless_ray.py."""
from __future__ import annotations

import pytest

from bench.lossless.cases import CASES_BY_NAME
from bench.lossless.controls import CONTROLS
from bench.lossless.report import case_passed, sample_case
from bench.lossless.stats import judge
from tests.bench.lossless.fixtures import tiny_models  # noqa: F401  (session fixture)

FAST_CASES = ["pld-tree", "draft-tree", "eagle3-tree", "mixed-batch-draft-tree", "draft-tree-pipelined",
              "suffix-tree-planned", "rest-tree", "lookahead-tree", "draft-tree-penalties", "draft-tree-grammar",
              "pld-tree-grammar-penalties", "keyed-draft-tree", "keyed-rest-tree", "keyed-lookahead-tree", "keyed-eagle3-tree",
              "keyed-parallel-tree",
              "keyed-mixed-batch-draft-tree", "keyed-pld-tree-grammar-penalties"]
FAST_SAMPLES = 2_000


@pytest.mark.parametrize("name", FAST_CASES)
def test_sampled_sequences_follow_the_target(tiny_models, name):
    groups, speculation = sample_case(CASES_BY_NAME[name], tiny_models, FAST_SAMPLES)
    verdict = judge(groups)
    assert verdict.passed, verdict
    assert verdict.impossible == 0  # greedy requests of the mixed batch: all on the greedy path
    assert speculation["accepted"] > 0.1 * FAST_SAMPLES  # drafts were accepted, not only rejected
    if CASES_BY_NAME[name].keyed:  # and every seeded sequence is the one plain decoding gives
        assert speculation["differ_from_plain"] == 0


@pytest.mark.parametrize("control", CONTROLS, ids=lambda c: c.name)
def test_a_verifier_with_a_deliberate_mistake_is_caught(tiny_models, control):
    case = CASES_BY_NAME[control.cases[0]]
    groups, speculation = sample_case(case, tiny_models, FAST_SAMPLES, control)
    assert not case_passed(judge(groups), speculation)  # the real verifier passes these seeds (the full set)

