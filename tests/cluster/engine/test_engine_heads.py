"""Trained-head drafters (EAGLE-3 chain and dynamic tree, an EAGLE-1/2 checkpoint, Medusa, a DFlash
block drafter, and suffix decoding with an EAGLE-3 head behind it) through the engine: greedy output identical to
plain decoding, sampled output with the target's distribution. The heads read the target's hidden
states, which prefill and verification return."""
from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from actors.messages import AdmitItem
from actors.target_worker import TargetWorker
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.request import GenerationRequest
from speculators.hidden import TargetHidden
from speculators.lookahead import LookaheadConfig
from speculators.proposers.base import DraftRequest
from speculators.proposers.eagle import EagleProposer
from speculators.proposers.hybrid import HybridProposer, expected_accepted
from speculators.proposers.medusa import MedusaProposer
from speculators.proposers.parallel import ParallelProposer
from speculators.proposers.suffix import SuffixProposer
from speculators.sampling import SamplingParams
from tests.cluster.engine.test_engine_lossless import (  # noqa: F401  (plain_outputs is a fixture)
    LOOKAHEADS,
    PROMPTS,
    STEEP,
    exact_two_token_distribution,
    plain_outputs,
    run_engine,
)
from tests.conftest import IdTokenizer, tiny_pair
from tests.speculators.heads_fixtures import LAYERS, random_dflash, random_eagle1, random_eagle3, random_medusa

KINDS = ["eagle3", "eagle3-tree", "eagle1", "medusa", "suffix+eagle3", "parallel-tree"]
TRAINED = ("eagle3", "eagle3-tree", "medusa", "suffix+eagle3")
"""Kinds whose tests use heads trained on the tiny target (their drafts get accepted); the EAGLE-1
head is random (no trainer here) and so is the DFlash drafter here (tests/speculators/test_train.py
trains one), so only their losslessness is tested."""
MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


def head_proposer(kind: str, model, trained=None, vocab: int = 64, draft_vocab: int = 48):
    """A head of `kind` (trained when `trained` heads are given) wired to `model` as build_proposer
    wires a co-located one."""
    width = 3 if kind.endswith("tree") else 1
    if kind.startswith("suffix+"):
        return HybridProposer(SuffixProposer(), head_proposer(kind.removeprefix("suffix+"), model, trained, vocab,
                                                              draft_vocab))
    if kind.startswith("eagle3"):
        head = trained[0] if trained else random_eagle3(draft_vocab=draft_vocab, vocab=vocab)
        head = copy.deepcopy(head).to(model.dtype)
        head.share_target(model.model.embed_tokens.weight)
        return EagleProposer(head, width)
    if kind.startswith("parallel"):
        drafter = random_dflash(vocab=vocab).to(model.dtype)
        drafter.share_target(model.model.embed_tokens.weight, model.head_weight())
        return ParallelProposer(drafter, MEDUSA_TREE[:7] if kind.endswith("tree") else None)
    if kind == "eagle1":
        head = random_eagle1(vocab=vocab).to(model.dtype)
        head.share_target(model.model.embed_tokens.weight, model.head_weight())
        return EagleProposer(head)
    heads = copy.deepcopy(trained[1]) if trained else random_medusa(draft_vocab=draft_vocab, vocab=vocab)
    return MedusaProposer(heads.to(model.dtype), LAYERS, MEDUSA_TREE)


@pytest.mark.parametrize("kind,lookahead", list(itertools.product(KINDS, LOOKAHEADS)),
                         ids=lambda v: v if isinstance(v, str)
                         else f"{v.policy}-{v.num_speculative_tokens}-{v.confidence_threshold}")
def test_greedy_speculation_with_a_head_is_token_identical(tiny_model, tiny_heads, plain_outputs, kind, lookahead):
    model, _ = tiny_model
    outputs = run_engine(model, head_proposer(kind, model, tiny_heads), PROMPTS, lookahead)
    assert [o.token_ids for o in outputs] == plain_outputs
    assert sum(o.stats.drafted for o in outputs) > 0
    if kind in TRAINED:
        assert sum(o.stats.accepted for o in outputs) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_planned_head_drafts_keep_greedy_output_identical(tiny_model, tiny_heads, plain_outputs, kind):
    """The planner sizes the head's depth before it drafts and trims its trees by confidence."""
    model, _ = tiny_model
    planned = run_engine(model, head_proposer(kind, model, tiny_heads), PROMPTS, lookahead=None, cost=STEEP)
    assert [o.token_ids for o in planned] == plain_outputs
    chosen = run_engine(model, head_proposer(kind, model, tiny_heads), PROMPTS, lookahead=None)
    assert sum(o.stats.drafted for o in planned) < sum(o.stats.drafted for o in chosen)


def test_trained_heads_are_accepted_more_than_random_ones(tiny_model, tiny_heads, plain_outputs):
    model, _ = tiny_model
    fixed = LookaheadConfig(policy="fixed", num_speculative_tokens=4)
    for kind in ("eagle3", "medusa"):
        trained = run_engine(model, head_proposer(kind, model, tiny_heads), PROMPTS, fixed)
        untrained = run_engine(model, head_proposer(kind, model), PROMPTS, fixed)
        assert sum(o.stats.accepted for o in trained) > 2 * sum(o.stats.accepted for o in untrained)
        assert np.mean([o.mean_accepted_tokens for o in trained]) > 1.2


def test_heads_get_the_hidden_states_they_read(tiny_model):
    """Prefill and every verification hand the head its rows: it drafts at every step."""
    model, _ = tiny_model
    proposer = head_proposer("eagle3", model)
    config = SchedulerConfig(max_sequences=4, max_len=256, min_acceptance=0)  # drafts even when all are rejected
    engine = local_engine(model, IdTokenizer(), proposer, config)
    assert engine.target.target.hidden_layers == proposer.hidden_layers
    fixed = LookaheadConfig(policy="fixed", num_speculative_tokens=3)
    outputs = engine.generate([GenerationRequest(f"r{i}", p, max_new_tokens=12, lookahead=fixed)
                               for i, p in enumerate(PROMPTS)])
    for output in outputs:  # every pass drafted, but those with too few tokens left to make
        assert output.stats.drafted_per_position[0] >= output.stats.target_forwards - 2
    assert not engine._hidden._pieces  # nothing left behind for finished requests


def test_the_hybrid_drafts_from_suffix_decoding_where_the_text_repeats_and_from_the_head_elsewhere(tiny_model):
    model, _ = tiny_model
    hybrid = HybridProposer(SuffixProposer(), head_proposer("eagle3", model))
    target = TargetWorker(model, max_sequences=2, max_len=64, hidden_layers=hybrid.hidden_layers)
    prompts = {"repeats": [5, 6, 7, 8, 9] * 4, "fresh": [11, 12, 13, 14, 15]}
    rows = target.start([AdmitItem(request_id=name, tokens=tokens, sampling=SamplingParams())
                         for name, tokens in prompts.items()]).hidden
    requests = [DraftRequest(name, tokens, 6, 16, hidden=TargetHidden(0, rows[name])) for name, tokens in prompts.items()]
    alone = SuffixProposer().propose(requests)
    assert expected_accepted(alone[0]) >= 1.0 > expected_accepted(alone[1])
    trees = hybrid.propose(requests)
    assert trees[0].token_ids == alone[0].token_ids  # the repeat: suffix decoding's run
    assert alone[1].num_drafted == 0 and trees[1].num_drafted > 0  # elsewhere: the head's draft


def test_the_hybrid_runs_the_head_only_when_it_drafts_and_hands_it_the_rows_it_missed(tiny_model):
    """Steps served by suffix decoding make no head call; the head's next draft then catches up on
    their rows too, and drafts what a head that saw every row drafts."""
    model, _ = tiny_model
    hybrid = HybridProposer(SuffixProposer(), head_proposer("eagle3", model))
    asked = []
    propose = hybrid.head.propose
    hybrid.head.propose = lambda requests: asked.append([r.request_id for r in requests]) or propose(requests)
    target = TargetWorker(model, max_sequences=1, max_len=64, hidden_layers=hybrid.hidden_layers)
    tokens = [5, 6, 7, 8, 9] * 4 + [20, 21, 22]
    admission = target.start([AdmitItem(request_id="r", tokens=tokens, sampling=SamplingParams())])
    rows = admission.hidden["r"]  # every committed token's row but the root's
    repeat = hybrid.propose([DraftRequest("r", tokens[:20], 6, 16, hidden=TargetHidden(0, rows[:19]))])[0]
    assert expected_accepted(repeat) >= 1.0 and not asked
    fresh = hybrid.propose([DraftRequest("r", tokens, 6, 16, hidden=TargetHidden(19, rows[19:]))])[0]
    assert asked == [["r"]]
    alone = head_proposer("eagle3", model).propose([DraftRequest("r", tokens, 6, 16, hidden=TargetHidden(0, rows))])[0]
    assert fresh.num_drafted > 0 and fresh.token_ids == alone.token_ids and fresh.parents == alone.parents


@pytest.mark.parametrize("kind", ["eagle3", "eagle3-tree", "medusa", "suffix+eagle3", "parallel-tree"])
def test_rejection_sampled_output_with_a_head_follows_the_target(kind):
    """Rejection sampling against the head's probabilities: chi-square over the 64 cells of (first,
    second) token, 6,000 samples; the heads draft from 6 of the 8 tokens (FR-Spec), so the two
    others only come from rejections."""
    model, reference = tiny_pair(seed=5, vocab_size=8)
    params = SamplingParams(temperature=1.0, top_k=6, seed=11)
    prompt = [1, 2, 3, 4]
    samples, batch = 6000, 500
    counts = np.zeros((8, 8))
    for start in range(0, samples, batch):
        proposer = head_proposer(kind, model, vocab=8, draft_vocab=6)
        engine = local_engine(model, IdTokenizer(), proposer, SchedulerConfig(max_sequences=batch, max_len=16,
                                                                                       kv_cache_bytes=batch * 16
                                                               * model.kv_bytes_per_position()))
        requests = [GenerationRequest(f"r{start + i}", prompt, SamplingParams(1.0, 6, 1.0, seed=start + i, rule="rejection"), 2,
                                      lookahead=LookaheadConfig(policy="fixed", max_tokens=3))
                    for i in range(batch)]
        for output in engine.generate(requests):
            counts[output.token_ids[0], output.token_ids[1]] += 1
    exact = exact_two_token_distribution(reference, prompt, params)
    keep = exact > 0
    assert counts[~keep].sum() == 0
    expected = exact[keep] / exact[keep].sum() * samples
    assert chisquare(counts[keep], expected).pvalue > 1e-3
