"""Logprobs and penalties through the engine: identical with speculation on and off, for every
drafter, and equal to transformers where transformers has the feature."""
from __future__ import annotations

import pytest
import torch

from speculators.penalties import Penalties
from speculators.sampling import SamplingParams
from tests.cluster.engine.test_engine_lossless import PROMPTS, make_proposer, run_engine

KINDS = ["pld", "pld-tree", "suffix", "draft", "draft-tree"]
NEW_TOKENS = 16


def run(model, kind, prompts=PROMPTS, **request):
    proposer = None if kind == "none" else make_proposer(kind, model, len(prompts))
    return run_engine(model, proposer, prompts, max_new_tokens=NEW_TOKENS, **request)


@pytest.fixture(scope="module")
def plain_logprobs(tiny_model):
    model, _ = tiny_model
    return run(model, "none", logprobs=4)


def test_logprobs_equal_transformers(tiny_model, plain_logprobs):
    """The chosen token's log-probability and the top 4, from the target's raw distribution."""
    _, reference = tiny_model
    for prompt, output in zip(PROMPTS, plain_logprobs):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + output.token_ids[:-1]])).logits[0, len(prompt) - 1:]
        expected = logits.double().log_softmax(-1)
        assert [e.token for e in output.logprobs] == output.token_ids
        for row, entry in zip(expected, output.logprobs):
            assert entry.logprob == pytest.approx(float(row[entry.token]), abs=1e-5)
            assert [t for t, _ in entry.top] == row.topk(4).indices.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_are_the_same_with_speculation(tiny_model, plain_logprobs, kind):
    model, _ = tiny_model
    outputs = run(model, kind, logprobs=4)
    assert sum(o.stats.accepted for o in outputs) > 0
    for got, plain in zip(outputs, plain_logprobs):
        assert got.token_ids == plain.token_ids
        assert len(got.logprobs) == len(plain.logprobs)
        for a, b in zip(got.logprobs, plain.logprobs):
            assert (a.token, [t for t, _ in a.top]) == (b.token, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)  # the pass's shape changes float rounding only


def test_repetition_penalty_equals_transformers_generate(tiny_model):
    model, reference = tiny_model
    outputs = run(model, "none", penalties=Penalties(repetition=1.7))
    for prompt, output in zip(PROMPTS, outputs):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      do_sample=False, repetition_penalty=1.7)[0, len(prompt):].tolist()
        assert output.token_ids == expected


PENALTIES = [Penalties(repetition=1.7), Penalties(presence=1.5, frequency=0.8), Penalties(0.5, -0.5, 1.3)]


@pytest.mark.parametrize("penalties", PENALTIES, ids=["repetition", "presence-frequency", "all"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_penalties_is_the_penalised_plain_decoding(tiny_model, kind, penalties):
    model, _ = tiny_model
    plain = run(model, "none", penalties=penalties)
    outputs = run(model, kind, penalties=penalties)
    assert [o.token_ids for o in outputs] == [p.token_ids for p in plain]
    assert [p.token_ids for p in plain] != [o.token_ids for o in run(model, "none")]  # the penalties mattered


def test_penalties_make_sampled_output_repeat_less(tiny_model):
    """What OpenAI documents: positive presence and frequency penalties make repeated tokens rarer."""
    model, _ = tiny_model
    prompts = [[token] * 12 for token in range(8)]

    def repeats(penalties):  # at temperature 0.3 this random model repeats itself
        outputs = run(model, "pld", prompts, sampling=SamplingParams(0.3, seed=5), penalties=penalties)
        return sum(len(o.token_ids) - len(set(o.token_ids)) for o in outputs)

    assert repeats(Penalties(presence=2.0, frequency=2.0)) < repeats(None)
