"""A DFlash block drafter trained here on the tiny target's own answers, as `specserve train dflash`
trains one: its held-out figures, and its drafts accepted through the engine with greedy output
identical to plain decoding."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from speculators.lookahead import LookaheadConfig
from speculators.proposers.parallel import ParallelProposer
from speculators.train.dataset import Example
from speculators.train.dflash import DFlashObjective, new_drafter
from speculators.train.loop import TrainConfig, train
from tests.cluster.engine.test_engine_lossless import PROMPTS, plain_outputs, run_engine  # noqa: F401
from tests.conftest import tiny_hf_config
from tests.speculators.heads_fixtures import AUX, HIDDEN, LAYERS, VOCAB, random_dflash, tiny_training_data

FIXED = LookaheadConfig(policy="fixed", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """(drafter, held-out figures) after a few seconds of training."""
    model, _ = tiny_model
    torch.manual_seed(0)
    width = [*AUX, LAYERS]
    keep = torch.cat([torch.arange(HIDDEN) + width.index(layer) * HIDDEN for layer in AUX])
    examples = [Example(e.index, e.tokens, e.hidden[:, keep].float(), e.prompt_length, e.held_out)
                for e in tiny_training_data(model)]
    drafter = new_drafter(tiny_hf_config(), tuple(layer - 1 for layer in AUX), 1, 4, VOCAB - 1)
    drafter.share_target(model.model.embed_tokens.weight.float(), model.head_weight().float())
    objective = DFlashObjective(drafter, anchors=256)
    config = TrainConfig(epochs=30, batch_rows=1024, lr=1e-2, warmup_steps=10, eval_every=10_000,
                         checkpoint_every=10_000, autocast=False)
    held = train(drafter, objective, [e for e in examples if not e.held_out], [e for e in examples if e.held_out],
                 config, tmp_path_factory.mktemp("dflash"), log=lambda _: None)
    return drafter, objective.summary(held)


def proposer(drafter, model) -> ParallelProposer:
    drafter = copy.deepcopy(drafter).to(model.dtype)
    drafter.share_target(model.model.embed_tokens.weight, model.head_weight())
    return ParallelProposer(drafter)


def test_training_teaches_every_depth_of_the_block(trained):
    _, figures = trained
    assert figures["top1@1"] > 0.4 and figures["top1@3"] > 0.1
    assert figures["accept"] > 1.4


def test_a_trained_block_drafter_is_accepted_and_output_stays_identical(tiny_model, trained, plain_outputs):
    model, _ = tiny_model
    drafter, _ = trained
    outputs = run_engine(model, proposer(drafter, model), PROMPTS, FIXED)
    assert [o.token_ids for o in outputs] == plain_outputs
    accepted = sum(o.stats.accepted for o in outputs)
    untrained = run_engine(model, proposer(random_dflash().float(), model), PROMPTS, FIXED)
    assert accepted > 2 * sum(o.stats.accepted for o in untrained)
    assert np.mean([o.mean_accepted_tokens for o in outputs]) > 1.2  # the trained EAGLE-3 and Medusa heads' bar
