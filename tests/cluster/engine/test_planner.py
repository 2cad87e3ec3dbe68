"""The cost curve and goodput-based draft sizing."""
import json
import time

import numpy as np
import pytest
import torch

from actors.model.runner import ModelRunner
from actors.model.timing import time_passes
from cluster.engine import cost
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.cost import CostCurve, CostPoint, measure, shapes_for
from cluster.engine.learned_cost import DrafterCost, StepCost
from cluster.engine.planner import (
    EXPLORE_EVERY,
    Acceptance,
    DraftCallGate,
    Planned,
    Planner,
    path_probabilities,
    subtree,
)
from cluster.engine.request import GenerationRequest
from speculators.lookahead import LookaheadConfig
from speculators.proposers.prompt_lookup import PromptLookupProposer
from speculators.tree import DraftTree
from tests.conftest import IdTokenizer


def curve(per_token: float, base: float = 1.0, flat_until: int = 1) -> CostCurve:
    """A pass costs `base` up to `flat_until` tokens, then `per_token` more per token."""
    return CostCurve([CostPoint(t, 1, base + per_token * max(0, t - flat_until)) for t in (1, 2, 4, 8, 16, 32, 64)])


def chain(length: int, confidence: float) -> DraftTree:
    return DraftTree.chain(0, list(range(1, length + 1)), confidence=[1.0] + [confidence] * length)


def test_cost_curve_interpolates_never_dips_and_charges_for_more_sequences():
    cost = CostCurve([CostPoint(1, 1, 1.0), CostPoint(8, 1, 2.0), CostPoint(16, 1, 1.8), CostPoint(16, 4, 2.6)])
    assert cost.seconds(4) == pytest.approx(1 + 3 / 7)
    assert cost.seconds(16) == 2.0  # the measured dip at 16 is ignored
    assert cost.seconds(16, 4) == pytest.approx(2.6)
    assert cost.seconds(100) >= cost.seconds(16)
    assert CostCurve.from_json(json.loads(json.dumps(cost.to_json()))).seconds(16, 4) == cost.seconds(16, 4)


def test_a_flat_cost_keeps_likely_nodes_and_a_steep_cost_keeps_none():
    likely = chain(6, 0.9)
    flat = Planner(curve(per_token=0.0, flat_until=64))
    steep = Planner(curve(per_token=1.0))
    for planner in (flat, steep):
        planner.acceptance = calibrated({0.9: 0.9})
    assert flat.trim([Planned(likely, True)])[0].num_drafted == 6
    assert steep.trim([Planned(likely, True)])[0].num_drafted == 0


def test_a_full_batch_drafts_less_than_a_lone_request():
    planner = Planner(curve(per_token=0.15, flat_until=4))
    planner.acceptance = calibrated({0.6: 0.6})
    alone = planner.trim([Planned(chain(8, 0.6), True)])
    batch = planner.trim([Planned(chain(8, 0.6), True) for _ in range(16)])
    assert alone[0].num_drafted > 0
    assert sum(t.num_drafted for t in batch) / 16 < alone[0].num_drafted


def test_sampled_trees_are_never_trimmed():
    planner = Planner(curve(per_token=1.0))
    sampled = DraftTree.chain(0, [1, 2, 3], draft_probs=torch.full((4, 5), 0.2), confidence=[1.0, 0.1, 0.1, 0.1])
    kept = planner.trim([Planned(sampled, trimmable=False), Planned(chain(3, 0.1), trimmable=True)])
    assert [t.num_drafted for t in kept] == [3, 0]


def test_trimming_keeps_parents_with_children_and_remaps_the_tree():
    tree = DraftTree([0, 5, 6, 7, 8], [-1, 0, 1, 0, 3], confidence=[1.0, 0.9, 0.9, 0.2, 0.9])
    kept = subtree(tree, [1, 2])
    assert kept.token_ids == [0, 5, 6] and kept.parents == [-1, 0, 1] and kept.confidence == [1.0, 0.9, 0.9]
    planner = Planner(curve(per_token=0.3))
    planner.acceptance = calibrated({0.9: 0.9, 0.2: 0.2})
    trimmed = planner.trim([Planned(tree, True)])[0]
    assert trimmed.token_ids[:3] == [0, 5, 6] and 8 not in trimmed.token_ids


def test_a_step_is_priced_by_what_steps_took_not_only_by_the_curve():
    """Served, a step pays what the startup curve never timed: here 1.3x the curve, 3 ms more, and 2 ms
    a drafted token for verifying it."""
    timed = curve(per_token=0.002, base=0.02, flat_until=4)
    step = StepCost(timed)
    assert step.seconds(8, 4, drafted=4) == pytest.approx(timed.seconds(8, 4))  # nothing seen: the curve
    served = lambda tokens, drafted: 1.3 * timed.seconds(tokens, 4) + 0.003 + 0.002 * drafted  # noqa: E731
    for drafted in [0, 4, 12, 1, 20, 0, 8, 2] * 40:
        step.observe(4 + drafted, 4, drafted, served(4 + drafted, drafted))
    for drafted in (0, 6, 16):
        assert step.seconds(4 + drafted, 4, drafted) == pytest.approx(served(4 + drafted, drafted), rel=0.05)


def test_steps_faster_than_the_curve_never_make_drafted_tokens_cheaper_than_it_says():
    """The curve is the fastest each pass ran: a step that ran faster (a shorter context, a curve
    timed on a slower day) leaves the price at the curve instead of cutting what a token costs."""
    timed = curve(per_token=0.01, base=0.01)
    planner = Planner(timed)
    for drafted in [0, 3, 6, 1] * 50:  # every step took a tenth of what the curve says
        planner.step.observe(1 + drafted, 1, drafted, 0.1 * timed.seconds(1 + drafted))
    for drafted in (0, 3, 6):
        assert planner.step.seconds(1 + drafted, 1, drafted) == pytest.approx(timed.seconds(1 + drafted))
    planner.acceptance = calibrated({0.3: 0.3})
    assert planner.trim([Planned(chain(6, 0.3), True)])[0].num_drafted == 0  # a token costs a whole step


def test_the_step_fit_is_the_least_squares_fit_with_no_negative_coefficient():
    from scipy.optimize import nnls

    from cluster.engine.learned_cost import _non_negative_solve

    rng = np.random.default_rng(0)
    for _ in range(100):
        features, seconds = rng.normal(size=(20, 3)), rng.normal(size=20)
        expected, _ = nnls(features, seconds)
        assert _non_negative_solve(features.T @ features, features.T @ seconds) == pytest.approx(expected, abs=1e-9)


def test_a_planner_that_sees_drafted_tokens_cost_more_than_the_curve_keeps_fewer():
    likely = chain(6, 0.9)
    planner = Planner(curve(per_token=0.0, base=0.02, flat_until=64))
    planner.acceptance = calibrated({0.9: 0.9})
    assert planner.trim([Planned(likely, True)])[0].num_drafted == 6
    assert planner.last_saving > 0
    for drafted in [0, 3, 6, 1] * 50:  # each drafted token doubled the step
        planner.step.observe(1 + drafted, 1, drafted, 0.02 * (1 + drafted))
    assert planner.trim([Planned(likely, True)])[0].num_drafted == 0
    assert planner.last_saving == 0


def test_a_drafter_call_that_costs_more_than_it_saves_is_made_only_now_and_then():
    gate = DraftCallGate()
    assert gate.calls(4)  # nothing known yet
    gate.observe(4, saving=0.001, cost=0.004)
    calls = [gate.calls(4) for _ in range(7 * EXPLORE_EVERY)]
    assert [step for step, called in enumerate(calls, start=1) if called] == [EXPLORE_EVERY, 3 * EXPLORE_EVERY,
                                                                             7 * EXPLORE_EVERY]
    assert gate.calls(1) and gate.calls(16)  # other batch sizes keep their own record
    for _ in range(10):  # prompts that pay again, seen by an exploring call
        gate.observe(4, saving=0.02, cost=0.004)
    assert all(gate.calls(4) for _ in range(3 * EXPLORE_EVERY))


def test_acceptance_learns_what_the_target_accepts():
    acceptance = Acceptance()
    tree = chain(2, 0.95)
    for _ in range(50):
        acceptance.observe(tree, [0])  # the first node was always rejected
    assert acceptance.probability(0.95, 1) < 0.1
    assert path_probabilities(tree, acceptance)[1] < 0.1


def test_a_trees_siblings_do_not_count_against_how_deep_it_pays_to_draft():
    """A width-4 tree whose path is accepted 3 deep: each node had 1 in 4, each depth was reached."""
    tokens, parents = [0], [-1]
    for depth in range(3):
        first = len(tokens)
        tokens += [10 * depth + k for k in range(1, 5)]
        parents += [first - 4 if depth else 0] * 4
    tree = DraftTree(tokens, parents)
    planner = Planner(curve(per_token=0.01))
    for _ in range(50):
        planner.acceptance.observe(tree, [0, 1, 5, 9])  # the first sibling at each depth
    assert planner.acceptance.probability(None, 2) < 0.3
    assert planner.acceptance.reach(2) > 0.9 and planner.acceptance.reach(3) > 0.9
    assert planner.depth(1, 3, drafter_costing(0, 0, 0.02)) == 3


def drafter_costing(fixed: float, per_row: float, per_depth: float) -> DrafterCost:
    """A DrafterCost that has seen calls of several shapes, all costing exactly this."""
    drafter = DrafterCost()
    for rows, depth in [(300, 4), (2, 4), (1, 1), (3, 8), (40, 2), (1, 6)]:
        drafter.observe(rows, depth, fixed + per_row * rows + per_depth * depth)
    return drafter


def test_a_costly_drafter_is_told_to_draft_shallower_when_its_passes_cost_more():
    planner = Planner(curve(per_token=0.01))
    assert planner.depth(1, 8, drafter_costing(0, 0, 0.0)) > planner.depth(1, 8, drafter_costing(0, 0, 1.0))
    assert planner.depth(1, 8, drafter_costing(0, 0, 10.0)) == 0


def test_the_drafters_cost_is_split_between_catching_up_and_drafting():
    """A head's first call reads a whole prompt: charged to its depth, that made drafting look dear."""
    fixed, per_row, per_depth = drafter_costing(0.002, 0.0001, 0.003).coefficients()
    assert fixed == pytest.approx(0.002, abs=1e-6)
    assert per_row == pytest.approx(0.0001, abs=1e-7)
    assert per_depth == pytest.approx(0.003, abs=1e-6)
    planner = Planner(curve(per_token=0.01))
    for _ in range(20):
        planner.acceptance.observe(chain(4, 0.9), [0, 1, 2, 3, 4])  # every drafted token accepted
    assert planner.depth(1, 8, drafter_costing(0.002, 0.001, 0.003)) > 0  # a 300-token prompt cost 0.3 s


def test_a_stopped_drafter_still_drafts_now_and_then_to_learn_whether_it_pays_again():
    planner = Planner(curve(per_token=0.01))
    dear = drafter_costing(0, 0, 10.0)
    depths = [planner.depth(1, 8, dear) for _ in range(7 * EXPLORE_EVERY)]
    explored = [step for step, depth in enumerate(depths, start=1) if depth]
    assert set(depths) == {0, 1}
    assert explored == [EXPLORE_EVERY, 3 * EXPLORE_EVERY, 7 * EXPLORE_EVERY]  # each try that fails waits twice as long
    assert planner.depth(1, 8, drafter_costing(0, 0, 0.0)) > 0
    assert planner.exploration.explore_after == EXPLORE_EVERY  # drafting again: the next stop explores soon
    assert planner.depth(1, 0, dear) == 0  # nothing to explore when no request may draft


def test_timed_passes_leave_the_runner_as_they_found_it(tiny_model):
    model, _ = tiny_model
    runner = ModelRunner(model, 4, 128)
    seconds = time_passes(runner, [(1, 1), (8, 1), (8, 4)], context=16, repeats=2)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert runner.pool.available == runner.pool.num_blocks  # every block was given back


def test_measured_curves_are_cached(tiny_model, tmp_path, monkeypatch):
    from actors.target_worker import TargetWorker
    from actors.worker import LocalWorker

    monkeypatch.setenv("SPECSERVE_COST_CURVES", str(tmp_path))
    model, _ = tiny_model
    worker = LocalWorker(TargetWorker(model, 4, 256))
    first = measure(worker, 4, 256, key="tiny", repeats=1)
    assert (tmp_path / "tiny.json").exists()
    assert measure(worker, 4, 256, key="tiny").to_json() == first.to_json()
    shapes, context = shapes_for(4, 256)
    assert {s for _, s in shapes} == {1, 2, 4} and context + max(t for t, _ in shapes) < 256


def test_a_curve_measured_before_the_decoder_changed_is_not_read(tmp_path, monkeypatch):
    """A faster kernel makes an old curve wrong: the key follows the decoder's code."""
    (tmp_path / "llama.py").write_text("slow = True\n")
    monkeypatch.setattr(cost, "DECODER_CODE", tmp_path)
    cost.decoder_fingerprint.cache_clear()
    before = cost.cache_key("smollm2-135m", "float32")
    (tmp_path / "llama.py").write_text("slow = False\n")
    cost.decoder_fingerprint.cache_clear()
    assert cost.cache_key("smollm2-135m", "float32") != before
    monkeypatch.undo()
    cost.decoder_fingerprint.cache_clear()


def calibrated(rates: dict[float, float]) -> Acceptance:
    """An Acceptance that has seen nodes of each confidence accepted at the given rate."""
    acceptance = Acceptance()
    for confidence, rate in rates.items():
        tree = chain(1, confidence)
        for trial in range(400):
            acceptance.observe(tree, [0, 1] if trial < rate * 400 else [0])
    return acceptance


def test_draft_workers_get_only_new_tokens_and_name_requests_they_lost():
    from actors.draft_worker import DraftWorker
    from cluster.engine.drafting import SentTokens
    from speculators.proposers.base import DraftRequest
    from speculators.proposers.prompt_lookup import PromptLookupProposer

    seen = []

    class Recording(PromptLookupProposer):
        def propose(self, requests):
            seen.extend(list(r.token_ids) for r in requests)
            return super().propose(requests)

    worker, sent = DraftWorker(Recording), SentTokens()
    first = sent.outgoing([DraftRequest("r", [1, 2, 3, 1, 2], 4, 4)])
    assert first[0].start == 0
    worker.propose(first)
    second = sent.outgoing([DraftRequest("r", [1, 2, 3, 1, 2, 3, 1], 4, 4)])
    assert (second[0].start, second[0].token_ids) == (5, [3, 1])
    assert worker.propose(second).trees[0].token_ids[:2] == [1, 2]
    assert seen[-1] == [1, 2, 3, 1, 2, 3, 1]  # the proposer sees the whole sequence
    restarted = DraftWorker(Recording)
    reply = restarted.propose(sent.outgoing([DraftRequest("r", [1, 2, 3, 1, 2, 3, 1, 2], 4, 4)]))
    assert reply.unknown == ["r"] and reply.trees[0].num_drafted == 0
    sent.forget(reply.unknown)
    assert sent.outgoing([DraftRequest("r", [1, 2, 3, 1, 2, 3, 1, 2, 3], 4, 4)])[0].start == 0


class SlowLookup(PromptLookupProposer):
    """Prompt lookup that takes 20 ms a call, as a small draft model would on a CPU."""

    runs_a_model = True

    def propose(self, requests):
        time.sleep(0.02)
        return super().propose(requests)


def test_an_in_process_drafters_time_reaches_the_stats_and_the_planner(tiny_model):
    """A worker in this process drafts inside `submit`: timing from after it read zero, and the
    planner then took a costly drafter's depth to be free."""
    model, _ = tiny_model
    engine = local_engine(model, IdTokenizer(), SlowLookup(), SchedulerConfig(max_sequences=2, max_len=256))
    output = engine.generate([GenerationRequest("r", [1, 2, 3, 4, 5, 1, 2, 3], max_new_tokens=12,
                                                lookahead=LookaheadConfig(policy="fixed", num_speculative_tokens=3))])[0]
    assert output.stats.draft_seconds >= 0.015 * output.stats.target_forwards  # asked at (nearly) every step
    assert engine.speculation.drafter_cost.seconds(1, 3) > 0.01  # microseconds when timed after submit


class SlowCheapLookup(PromptLookupProposer):
    """Prompt lookup whose every call takes 30 ms, as an actor's round trip on a loaded machine can:
    no model, so nothing tells the planner its depth matters, only the call."""

    calls = 0

    def propose(self, requests):
        SlowCheapLookup.calls += 1
        time.sleep(0.03)
        return super().propose(requests)


def test_a_cheap_drafter_whose_calls_cost_more_than_they_save_stops_being_called(tiny_model):
    """Passes of the tiny target take a millisecond: no draft saves 30 ms, so after its first calls the
    drafter is asked only when the gate explores, and the output is plain decoding's."""
    model, reference = tiny_model
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    engine = local_engine(model, IdTokenizer(), SlowCheapLookup(), SchedulerConfig(max_sequences=2, max_len=256),
                          cost=True)
    output = engine.generate([GenerationRequest("r", prompt, max_new_tokens=64)])[0]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert output.token_ids == expected[0, len(prompt):].tolist()
    assert output.stats.target_forwards > 30
    assert SlowCheapLookup.calls <= 5
    assert engine.counters.draft_calls_skipped >= output.stats.target_forwards - 5  # what the metric counts
