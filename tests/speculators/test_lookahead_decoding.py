"""Lookahead decoding: the window as a tree, Jacobi updates from the target's choices, the n-gram
pool and what the planner and the gate make of the window."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.engine.config import SchedulerConfig
from cluster.engine.planner import Planned, Planner
from cluster.engine.request import GenerationRequest
from cluster.engine.speculation import SpeculationController
from speculators.proposers.base import DraftRequest, VerifiedTree
from speculators.proposers.lookahead_decoding import (
    PRIOR_YIELD,
    RETRY_AFTER,
    WINDOW_CONFIDENCE,
    LookaheadProposer,
)
from speculators.tree import DraftTree, token_paths
from speculators.verify import verify_greedy
from tests.cluster.engine.test_planner import calibrated, curve

VOCAB = 50


def counting(path: tuple[int, ...]) -> int:
    """A target that always continues with the next number (what Jacobi iterations converge to at once)."""
    return (path[-1] + 1) % VOCAB


def request(tokens, verified=None, depth=20, nodes=64, request_id="r") -> DraftRequest:
    return DraftRequest(request_id, list(tokens), depth, nodes, verified=verified)


def step(proposer: LookaheadProposer, tokens: list[int], verified: VerifiedTree | None, target=counting):
    """One engine step with a greedy target: the tree, the target's choice at each node, what it keeps."""
    tree = proposer.propose([request(tokens, verified)])[0]
    predictions = [target(tuple(tokens) + path) for path in token_paths(tree.token_ids, tree.parents)]
    result = verify_greedy(tree, predictions)
    return tree, result, tokens + result.new_tokens, VerifiedTree(tree.token_ids, tree.parents, predictions)


def test_a_new_window_is_a_chain_of_context_tokens_worth_what_the_pool_yields():
    proposer = LookaheadProposer(window=4, ngram=3, candidates=2)
    tree = proposer.propose([request([7, 8, 9, 10, 11])])[0]
    assert tree.parents == [-1, 0, 1, 2, 3]  # the columns' first tokens, one guess a place
    assert set(tree.token_ids[1:]) <= {7, 8, 9, 10, 11}
    assert tree.confidence[1:] == [WINDOW_CONFIDENCE] * 4
    assert tree.extra_value[1:] == [pytest.approx(proposer.pool_yield)] * 4 and proposer.pool_yield > 0


def test_columns_grow_from_the_targets_choices_and_full_columns_become_pool_ngrams():
    proposer = LookaheadProposer(window=3, ngram=3, candidates=2)
    tokens = [1, 2, 3]
    _, result, tokens, verified = step(proposer, tokens, None)
    columns = [list(c) for c in proposer._windows["r"].columns]
    proposer.propose([request(tokens, verified)])
    window = proposer._windows["r"]
    shift = len(result.new_tokens) - 1
    # each verified column gained the target's token after it; the window moved on by what was accepted
    expected = [column + [verified.predictions[1 + index]] for index, column in enumerate(columns)][shift:]
    assert window.columns[:len(expected)] == expected
    # a second verification fills columns to N tokens: their n-grams enter the pool, keyed by their first token
    _, result, tokens, verified = step(proposer, tokens, verified)
    proposer.propose([request(tokens, verified)])
    pool = proposer._windows["r"].pool
    assert pool and all(len(tail) == 2 for tails in pool.values() for tail in tails)
    # the counting target's Jacobi iterations converge: every generated n-gram is a run of counting
    assert all(tail == ((first + 1) % VOCAB, (first + 2) % VOCAB) for first, tails in pool.items() for tail in tails)


def test_the_pool_drafts_the_ngrams_of_the_root_and_the_target_accepts_them():
    """Text that repeats (a target counting round 0..5): the window's n-grams come back as drafts."""
    proposer = LookaheadProposer(window=4, ngram=4, candidates=3)
    cycle = lambda path: (path[-1] + 1) % 6  # noqa: E731
    tokens, verified, from_pool = [1, 2, 3], None, 0
    for _ in range(16):
        pool = {first: dict(tails) for first, tails in proposer._windows["r"].pool.items()} if "r" in proposer._windows else {}
        tree, result, tokens, verified = step(proposer, tokens, verified, cycle)
        drafted = set(token_paths(tree.token_ids, tree.parents)[1:])
        from_pool += any(tuple(result.accepted_tokens[:len(tail)]) == tail and tail in drafted
                         for tail in pool.get(tree.token_ids[0], {}))
    assert from_pool > 0
    assert tokens == [(1 + k) % 6 for k in range(len(tokens))]  # the greedy walk is the target's own text
    assert proposer.pool_yield > PRIOR_YIELD  # the window's nodes earned more than assumed


def test_a_column_the_planner_cut_keeps_its_tokens_and_a_long_accept_shifts_the_window():
    proposer = LookaheadProposer(window=4, ngram=3, candidates=0)
    tokens = [20, 21, 22, 23]
    tree = proposer.propose([request(tokens)])[0]
    columns = [list(c) for c in proposer._windows["r"].columns]
    # only the first two columns' nodes were verified; the target kept nothing
    kept = DraftTree(tree.token_ids[:3], tree.parents[:3])
    verified = VerifiedTree(kept.token_ids, kept.parents, [30, 31, 32])
    proposer.propose([request(tokens + [30], verified)])
    assert proposer._windows["r"].columns == [columns[0] + [31], columns[1] + [32], columns[2], columns[3]]
    # three tokens committed at once: the window moves two columns further, new ones from the context
    proposer.propose([request(tokens + [30, 1, 2, 3])])
    window = proposer._windows["r"].columns
    assert window[:2] == [columns[2], columns[3]] and len(window) == 4 and all(len(c) == 1 for c in window[2:])


def test_the_planner_keeps_window_nodes_for_what_they_yield_later():
    window = DraftTree([0, 1, 2, 3], [-1, 0, 1, 2], confidence=[1.0] + [0.1] * 3)
    planner = Planner(curve(per_token=0.05))
    planner.acceptance = calibrated({0.1: 0.02})
    assert planner.trim([Planned(window, True)])[0].num_drafted == 0
    valued = DraftTree(window.token_ids, window.parents, confidence=window.confidence, extra_value=[0.0] + [0.2] * 3)
    kept = planner.trim([Planned(valued, True)])[0]
    assert kept.num_drafted == 3 and kept.extra_value == valued.extra_value


def test_rejected_window_nodes_never_close_a_requests_gate():
    controller = SpeculationController(SchedulerConfig(min_acceptance=0.1, gate_warmup_steps=2))
    state = SimpleNamespace(speculation=controller.for_request(GenerationRequest("r", [1, 2])))
    window = DraftTree([0, 1, 2, 3], [-1, 0, 1, 2], confidence=[1.0] + [0.1] * 3, extra_value=[0.0] + [0.05] * 3)
    for _ in range(20):
        controller.observe(state, window, verify_greedy(window, [9, 9, 9, 9]))
    assert state.speculation.gate.is_open
    plain_chain = DraftTree([0, 1, 2, 3], [-1, 0, 1, 2], confidence=[1.0] + [0.1] * 3)
    for _ in range(20):
        controller.observe(state, plain_chain, verify_greedy(plain_chain, [9, 9, 9, 9]))
    assert not state.speculation.gate.is_open


def test_a_window_the_planner_keeps_dropping_is_tried_again_from_the_prior():
    proposer = LookaheadProposer(window=2, ngram=3, candidates=1)
    proposer._learn_yield(0, 500)  # a long run of window nodes that brought nothing
    assert proposer.pool_yield < PRIOR_YIELD / 5
    for _ in range(RETRY_AFTER - 1):
        proposer._learn_yield(0, 0)  # the planner verified none of them
    assert proposer.pool_yield < PRIOR_YIELD / 5
    proposer._learn_yield(0, 0)
    assert proposer.pool_yield == pytest.approx(PRIOR_YIELD)
