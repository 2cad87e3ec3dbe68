"""A DFlash block drafter trained on the tiny target's own answers, as `specserve train dflash` trains
one (the `tiny_dflash` fixture): its held-out figures, and its drafts accepted through the engine
with greedy output identical to plain decoding."""
from __future__ import annotations

import copy

import numpy as np

from speculators.lookahead import LookaheadConfig
from speculators.proposers.parallel import ParallelProposer
from tests.cluster.engine.test_engine_lossless import PROMPTS, plain_outputs, run_engine  # noqa: F401
from tests.speculators.heads_fixtures import random_dflash

FIXED = LookaheadConfig(policy="fixed", num_speculative_tokens=3)


def proposer(drafter, model) -> ParallelProposer:
    drafter = copy.deepcopy(drafter).to(model.dtype)
    drafter.share_target(model.model.embed_tokens.weight, model.head_weight())
    return ParallelProposer(drafter)


def test_training_teaches_every_depth_of_the_block(tiny_dflash):
    _, figures = tiny_dflash
    assert figures["top1@1"] > 0.4 and figures["top1@3"] > 0.1
    assert figures["accept"] > 1.4


def test_a_trained_block_drafter_is_accepted_and_output_stays_identical(tiny_model, tiny_dflash, plain_outputs):
    model, _ = tiny_model
    drafter, _ = tiny_dflash
    outputs = run_engine(model, proposer(drafter, model), PROMPTS, FIXED)
    assert [o.token_ids for o in outputs] == plain_outputs
    accepted = sum(o.stats.accepted for o in outputs)
    untrained = run_engine(model, proposer(random_dflash().float(), model), PROMPTS, FIXED)
    assert accepted > 2 * sum(o.stats.accepted for o in untrained)
    assert np.mean([o.mean_accepted_tokens for o in outputs]) > 1.2  # the trained EAGLE-3 and Medusa heads' bar
