"""Seeded sampling that speculation cannot change: with a seed, a request's sampled tokens are the
same with speculation on or off, for every drafter, tree shape, lookahead, batch mix and
pipelining, and across repeated calls (speculators.keyed)."""
from __future__ import annotations

import pytest

from actors.model.runner import ModelRunner
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.request import GenerationRequest
from speculators.lookahead import LookaheadConfig
from speculators.penalties import Penalties
from speculators.proposers.draft_model import DraftModelProposer
from speculators.proposers.suffix import SuffixProposer
from speculators.sampling import SamplingParams
from tests.cluster.engine.test_engine_heads import head_proposer
from tests.cluster.engine.test_engine_lossless import PROMPTS, STEEP, make_proposer
from tests.conftest import IdTokenizer, tiny_pair

NEW_TOKENS = 24
FIXED = LookaheadConfig(policy="fixed", num_speculative_tokens=4)


def seeded(prompts=PROMPTS, temperature=0.7, rule="auto", tag="r", **sampling) -> list[GenerationRequest]:
    """Two requests of every prompt, seeded apart, plus a greedy one: a mixed batch."""
    batch = []
    for i, prompt in enumerate(prompts):
        for copy in range(2):
            params = SamplingParams(temperature, seed=1000 * i + copy, rule=rule, **sampling)
            batch.append(GenerationRequest(f"{tag}{i}.{copy}", prompt, params, NEW_TOKENS, lookahead=FIXED))
    batch.append(GenerationRequest(f"{tag}-greedy", PROMPTS[0], SamplingParams(), NEW_TOKENS, lookahead=FIXED))
    return batch


def generate(model, proposer, batch, slots=4, pipeline=False, cost=False):
    config = SchedulerConfig(max_sequences=slots, max_len=256, max_tree_nodes=32, pipeline=pipeline)
    return local_engine(model, IdTokenizer(), proposer, config, cost=cost).generate(batch)


def tokens(outputs) -> list[list[int]]:
    return [output.token_ids for output in outputs]


@pytest.fixture(scope="module")
def plain(tiny_model):
    return tokens(generate(tiny_model[0], None, seeded()))


def drafter(kind, model, heads):
    if kind == "draft-model":
        return DraftModelProposer(ModelRunner(tiny_pair(seed=3)[0], 4, 256), width=2)
    if kind.startswith(("eagle3", "medusa", "suffix+")):
        return head_proposer(kind, model, heads)
    return make_proposer(kind, model, 4)


METHODS = ["pld", "pld-tree", "suffix", "draft", "draft-tree", "draft-model", "eagle3", "eagle3-tree", "medusa",
           "suffix+eagle3"]
"""'draft' and 'draft-tree' are the layer-skip self-draft; 'draft-model' a separate model."""


@pytest.mark.parametrize("kind", METHODS)
def test_seeded_output_is_identical_with_speculation_on_or_off(tiny_model, tiny_heads, plain, kind):
    model, _ = tiny_model
    outputs = generate(model, drafter(kind, model, tiny_heads), seeded())
    assert tokens(outputs) == plain
    assert sum(o.stats.accepted for o in outputs[:-1]) > 0  # sampled drafts were kept, not only rejected


def test_the_rejection_rule_does_not_give_that_identity(tiny_model, tiny_heads):
    """What the keyed rule adds: the same seeds under rejection sampling give other tokens with
    speculation (the identity above is not something any lossless rule gives for free)."""
    model, _ = tiny_model
    off = tokens(generate(model, None, seeded(rule="rejection")))
    on = tokens(generate(model, drafter("eagle3", model, tiny_heads), seeded(rule="rejection")))
    assert on != off


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_batch_mix_slots_planner_and_pipelining_do_not_change_seeded_output(tiny_model, plain, pipeline):
    """Two slots for nine requests (joining mid-flight), the planner cutting trees, pipelined steps."""
    model, _ = tiny_model
    outputs = generate(model, drafter("draft-tree", model, None), seeded(), slots=2, pipeline=pipeline, cost=STEEP)
    assert tokens(outputs) == plain
    alone = [tokens(generate(model, drafter("pld", model, None), [request]))[0] for request in seeded()[:3]]
    assert alone == plain[:3]


def test_warps_and_penalties_keep_the_identity(tiny_model):
    model, _ = tiny_model
    shaped = dict(top_k=8, top_p=0.9)
    penalties = Penalties(presence=0.5, frequency=0.5, repetition=1.3)

    def batch():
        requests = seeded(temperature=1.2, **shaped)
        for request in requests:
            request.penalties = penalties
        return requests

    off = tokens(generate(model, None, batch()))
    assert tokens(generate(model, drafter("draft-tree", model, None), batch())) == off


def test_repeated_calls_are_identical_after_the_suffix_index_learned_other_outputs(tiny_model, plain):
    """Suffix decoding drafts from every earlier output (one shared scope here): what it drafts for a
    repeated call changes, its output does not."""
    model, _ = tiny_model
    config = SchedulerConfig(max_sequences=4, max_len=256, max_tree_nodes=32)
    engine = local_engine(model, IdTokenizer(), SuffixProposer(max_spec_factor=4.0), config)
    first = engine.generate(seeded(tag="a"))
    engine.generate(seeded(temperature=1.0, tag="other"))  # other outputs of the same prompts, learned
    again = engine.generate(seeded(tag="b"))
    assert tokens(first) == tokens(again) == plain
    assert sum(o.stats.drafted for o in again) > sum(o.stats.drafted for o in first)


def test_n_samples_seeded_apart_differ_and_each_reproduces(tiny_model):
    """Requests seeded s and s + 1 (what n > 1 sends) are different samples; each one alone is the
    same sample again."""
    model, _ = tiny_model
    pair = seeded()[:2]
    assert pair[0].sampling.seed + 1 == pair[1].sampling.seed
    first, second = tokens(generate(model, None, pair))
    assert first != second
    assert tokens(generate(model, drafter("suffix", model, None), [seeded()[1]])) == [second]


@pytest.mark.parametrize("rule", ["keyed", "rejection"])
def test_an_unseeded_request_is_verified_by_the_configured_rule(tiny_model, tiny_heads, rule):
    """A sampled request without a seed gets a random one (every rank and drafter draws alike) and
    `sampling_rule`'s rule: under rejection sampling its drafter sends the probabilities it drew from,
    under the keyed rule none. A seeded request is keyed whatever the setting."""
    model, _ = tiny_model
    proposer = drafter("eagle3-tree", model, tiny_heads)
    trees, propose = [], proposer.propose

    def recording(requests):
        drafted = propose(requests)
        trees.extend(tree for tree in drafted if tree.num_drafted > 0)
        return drafted

    proposer.propose = recording
    config = SchedulerConfig(max_sequences=4, max_len=256, max_tree_nodes=32, sampling_rule=rule)
    engine = local_engine(model, IdTokenizer(), proposer, config)
    unseeded = GenerationRequest("u", PROMPTS[0], SamplingParams(0.7), NEW_TOKENS, lookahead=FIXED)
    [output] = engine.generate([unseeded])
    assert len(output.token_ids) == NEW_TOKENS and trees
    assert unseeded.sampling.seed is not None and unseeded.sampling.rule == rule
    assert all((tree.draft_probs is not None) == (rule == "rejection") for tree in trees)
    [keyed] = seeded()[:1]
    local_engine(model, IdTokenizer(), None, config).generate([keyed])
    assert keyed.sampling.keyed
