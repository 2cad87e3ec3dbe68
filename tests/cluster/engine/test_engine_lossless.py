"""Losslessness end to end: the engine's output against the target's own decoding."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from actors.model.llama import layer_skip_draft
from actors.model.runner import ModelRunner
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.cost import CostCurve, CostPoint
from cluster.engine.request import GenerationRequest
from speculators.lookahead import LookaheadConfig
from speculators.proposers.draft_model import DraftModelProposer
from speculators.proposers.lookahead_decoding import LookaheadProposer
from speculators.proposers.prompt_lookup import PromptLookupProposer
from speculators.proposers.suffix import SuffixProposer
from speculators.sampling import SamplingParams
from tests.conftest import IdTokenizer, tiny_pair

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [3] * 12, list(range(10, 40))]
NEW_TOKENS = 24


def make_proposer(kind: str, model, slots: int):
    if kind == "pld":
        return PromptLookupProposer()
    if kind == "suffix":
        return SuffixProposer(max_spec_factor=4.0)
    if kind == "pld-tree":
        return PromptLookupProposer(num_tokens=6, max_branches=3)
    if kind == "lookahead":
        return LookaheadProposer(window=4, ngram=3, candidates=3)
    width = 3 if kind == "draft-tree" else 1
    return DraftModelProposer(ModelRunner(layer_skip_draft(model, 2), slots, 256), width=width)


def run_engine(model, proposer, prompts, lookahead=LookaheadConfig(), sampling=SamplingParams(), slots=4,
               max_new_tokens=NEW_TOKENS, max_tree_nodes=32, pipeline=False, cost=False, cache=None, **features):
    """`features`: further GenerationRequest fields (penalties, logprobs); `cache`: SchedulerConfig's
    KV cache fields (kv_cache_bytes, block_size, max_len)."""
    config = SchedulerConfig(**{"max_sequences": slots, "max_len": 256, "max_tree_nodes": max_tree_nodes,
                                "pipeline": pipeline, **(cache or {})})
    engine = local_engine(model, IdTokenizer(), proposer, config, cost=cost)
    requests = [GenerationRequest(f"r{i}", p, sampling, max_new_tokens, lookahead=lookahead, **features)
                for i, p in enumerate(prompts)]
    return engine.generate(requests)


@pytest.fixture(scope="module")
def plain_outputs(tiny_model):
    model, reference = tiny_model
    return [
        reference.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False)[0, len(p):].tolist()
        for p in PROMPTS
    ]


PIPELINE = pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])


@PIPELINE
def test_plain_decoding_equals_transformers_generate(tiny_model, plain_outputs, pipeline):
    model, _ = tiny_model
    outputs = run_engine(model, None, PROMPTS, pipeline=pipeline)
    assert [o.token_ids for o in outputs] == plain_outputs
    assert all(o.mean_accepted_tokens == 1.0 for o in outputs)


LOOKAHEADS = [
    LookaheadConfig(policy="fixed", num_speculative_tokens=4),
    LookaheadConfig(policy="heuristic"),
    LookaheadConfig(policy="confidence"),
    LookaheadConfig(policy="confidence", confidence_threshold=0.0, num_speculative_tokens=8),
]


@pytest.mark.parametrize("kind,lookahead",
                         list(itertools.product(["pld", "pld-tree", "suffix", "lookahead", "draft", "draft-tree"], LOOKAHEADS)),
                         ids=lambda v: v if isinstance(v, str)
                         else f"{v.policy}-{v.num_speculative_tokens}-{v.confidence_threshold}")
@PIPELINE
def test_greedy_speculation_is_token_identical(tiny_model, plain_outputs, kind, lookahead, pipeline):
    """Every proposer, policy, chain and tree shape, on a batch of prompts of mixed lengths."""
    model, _ = tiny_model
    outputs = run_engine(model, make_proposer(kind, model, 4), PROMPTS, lookahead, pipeline=pipeline)
    assert [o.token_ids for o in outputs] == plain_outputs
    assert sum(o.stats.accepted for o in outputs) > 0  # speculation actually happened


STEEP = CostCurve([CostPoint(t, 1, 1.0 + 0.08 * t) for t in (1, 2, 4, 8, 16, 32, 64)])
"""A pass costs 8% more per token: the planner keeps only likely nodes."""


@pytest.mark.parametrize("kind", ["pld", "pld-tree", "suffix", "lookahead", "draft", "draft-tree"])
@PIPELINE
def test_planned_drafts_keep_greedy_output_identical(tiny_model, plain_outputs, kind, pipeline):
    """The planner cuts trees to what pays (the engine's default): output unchanged, fewer tokens verified."""
    model, _ = tiny_model
    planned = run_engine(model, make_proposer(kind, model, 4), PROMPTS, lookahead=None, cost=STEEP, pipeline=pipeline)
    assert [o.token_ids for o in planned] == plain_outputs
    chosen = run_engine(model, make_proposer(kind, model, 4), PROMPTS, lookahead=None, pipeline=pipeline)
    assert sum(o.stats.drafted for o in planned) < sum(o.stats.drafted for o in chosen)


@pytest.mark.parametrize("kind", ["pld-tree", "draft"])
def test_a_requests_own_lookahead_caps_the_planner_and_never_bypasses_it(tiny_model, plain_outputs, kind):
    """A fixed lookahead of 4 is what a client may ask for: the planner still cuts what does not pay
    (under a steep cost curve), and never drafts deeper than the request allowed."""
    model, _ = tiny_model
    fixed = LookaheadConfig(policy="fixed", num_speculative_tokens=4)
    planned, unplanned = (run_engine(model, make_proposer(kind, model, 4), PROMPTS, fixed, cost=cost)
                          for cost in (STEEP, False))
    assert [o.token_ids for o in planned] == plain_outputs
    assert sum(o.stats.drafted for o in planned) < sum(o.stats.drafted for o in unplanned)
    assert all(len(o.stats.drafted_per_position) <= 4 for o in planned + unplanned)


@PIPELINE
def test_requests_joining_mid_flight_and_a_tight_budget(tiny_model, plain_outputs, pipeline):
    """Two cache slots for four requests (continuous batching) and at most 2 drafted nodes a tree."""
    model, _ = tiny_model
    outputs = run_engine(model, make_proposer("draft-tree", model, 2), PROMPTS, slots=2, max_tree_nodes=2,
                         pipeline=pipeline)
    assert [o.token_ids for o in outputs] == plain_outputs
    assert max(o.stats.drafted / o.stats.target_forwards for o in outputs) <= 2


SHARED = list(range(10, 40))
"""A prompt prefix several requests share (a system prompt): 7 full blocks of 4."""


@pytest.mark.parametrize("kind", ["suffix", "draft-tree"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
@PIPELINE
def test_prefix_hits_and_preemption_keep_the_output(tiny_model, kind, sampled, chunk, pipeline):
    """A KV cache of 24 blocks of 4 for requests of up to 62 positions each: requests share cached
    prompt blocks, wait for blocks, and are preempted and resumed mid-output (mostly from their own
    cached blocks). Every output is what the request gets alone in a roomy cache with whole
    prefills: greedy, and seeded sampling (keyed noise) alike; pipelined, a pass preempts requests
    of the other micro-batch too."""
    model, _ = tiny_model
    prompts = [SHARED + [1, 2], SHARED + [5], SHARED[:20] + [9, 9, 9], [7, 8, 9], SHARED + [1, 2, 3]]
    sampling = SamplingParams(temperature=1.0, seed=7) if sampled else SamplingParams()
    tight = {"kv_cache_bytes": 24 * 4 * model.kv_bytes_per_position(), "block_size": 4, "max_len": 96,
             "prefill_chunk_tokens": chunk}
    alone = [run_engine(model, make_proposer(kind, model, 1), [p], sampling=sampling, slots=1,
                        cache={"prefill_chunk_tokens": None})[0] for p in prompts]
    outputs = run_engine(model, make_proposer(kind, model, 8), prompts, sampling=sampling, slots=8, cache=tight,
                         pipeline=pipeline, cache_scope="tenant")
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    assert sum(o.stats.preemptions for o in outputs) > 0
    assert sum(o.stats.cached_prompt_tokens for o in outputs) >= 28
    assert sum(o.stats.accepted for o in outputs) > 0


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
def test_pipelined_requests_outgrowing_the_kv_cache_are_preempted_not_failed(tiny_model, plain_outputs, chunk):
    """Pipelined, in a KV cache of 16 blocks of 4 (64 positions) for four requests that grow to 149:
    a pass whose trees the cache has no room for preempts whichever running request is newest, of
    either micro-batch, so no request fails, the target is never taken for dead, and every output
    is plain decoding's."""
    model, _ = tiny_model
    config = SchedulerConfig(max_sequences=4, max_len=64, kv_cache_bytes=16 * 4 * model.kv_bytes_per_position(),
                             block_size=4, prefill_chunk_tokens=chunk, pipeline=True)
    engine = local_engine(model, IdTokenizer(), make_proposer("draft-tree", model, 4), config)
    outputs = engine.generate([GenerationRequest(f"r{i}", p, max_new_tokens=NEW_TOKENS) for i, p in enumerate(PROMPTS)])
    assert [o.token_ids for o in outputs] == plain_outputs
    assert {o.finish_reason for o in outputs} == {"length"}
    assert engine.counters.target_failures == 0 and engine.counters.preemptions > 0


def test_requests_arriving_together_compute_their_common_prefix_once(tiny_model):
    """Admitted in one step, chunked: the first computes the 7 shared blocks, the others take them
    from the prefix cache as they are filled; each output is what the request gets alone."""
    model, _ = tiny_model
    prompts = [SHARED + [1, 2], SHARED + [5], SHARED + [1, 2, 3]]
    alone = [run_engine(model, None, [p], cache={"prefill_chunk_tokens": None})[0] for p in prompts]
    outputs = run_engine(model, make_proposer("suffix", model, 8), prompts, cache_scope="tenant",
                         cache={"block_size": 4, "prefill_chunk_tokens": 8})
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    assert [o.stats.cached_prompt_tokens for o in outputs] == [0, 28, 32]  # the third shares the first's 8th block too


def test_prompts_with_nothing_to_prefill_decode_too(tiny_model):
    """A one-token prompt, and a prompt whose blocks are all cached, have no chunk to prefill."""
    model, _ = tiny_model
    prompts = [[5], SHARED[:9], SHARED[:9]]
    expected = [run_engine(model, None, [p], cache={"prefill_chunk_tokens": None})[0].token_ids for p in prompts]
    chunked = {"prefill_chunk_tokens": 4, "block_size": 4}
    outputs = [run_engine(model, None, [p], cache=chunked)[0] for p in prompts[:2]]
    engine = local_engine(model, IdTokenizer(), None, SchedulerConfig(max_len=64, **chunked))
    first, again = (engine.generate([GenerationRequest(name, prompts[2], max_new_tokens=NEW_TOKENS)])[0] for name in "ab")
    assert [o.token_ids for o in outputs] + [first.token_ids, again.token_ids] == expected + expected[2:]
    assert again.stats.cached_prompt_tokens == 8


def test_max_new_tokens_and_eos_stop_exactly(tiny_model, plain_outputs):
    model, _ = tiny_model
    outputs = run_engine(model, make_proposer("pld", model, 4), PROMPTS, max_new_tokens=5)
    assert [o.token_ids for o in outputs] == [p[:5] for p in plain_outputs]
    assert {o.finish_reason for o in outputs} == {"length"}
    eos = plain_outputs[2][3]
    engine = local_engine(model, IdTokenizer(), make_proposer("pld", model, 4), SchedulerConfig(max_len=256),
                          eos_token_ids=[eos])
    output = engine.generate([GenerationRequest("e", PROMPTS[2], max_new_tokens=NEW_TOKENS)])[0]
    assert output.token_ids == plain_outputs[2][: plain_outputs[2].index(eos) + 1]
    assert output.finish_reason == "stop"


def test_stop_strings_cut_the_text(tiny_model, plain_outputs):
    model, _ = tiny_model
    stop = f"t{plain_outputs[0][4]}"
    engine = local_engine(model, IdTokenizer(), make_proposer("pld", model, 2), SchedulerConfig(max_len=256))
    output = engine.generate([GenerationRequest("s", PROMPTS[0], max_new_tokens=NEW_TOKENS, stop=[stop])])[0]
    assert stop not in output.text and output.finish_reason == "stop"
    assert output.token_ids == plain_outputs[0][: len(output.token_ids)]


@pytest.mark.default_model
@pytest.mark.parametrize("method", ["pld", "draft"])
def test_default_model_greedy_is_identical(default_model_path, default_model_cost_curve, method):
    from cluster.engine.build import build_engine
    from cluster.engine.config import EngineConfig

    prompt = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
    engines = {m: build_engine(EngineConfig(model=str(default_model_path), method=m, max_sequences=1, max_len=512))
               for m in ("none", method)}
    outputs = {}
    for name, (engine, tokenizer) in engines.items():
        request = GenerationRequest(name, tokenizer.encode(prompt), max_new_tokens=40, speculate=name != "none")
        outputs[name] = engine.generate([request])[0]
    assert outputs[method].token_ids == outputs["none"].token_ids
    assert outputs[method].stats.drafted > 0
    if method == "pld":  # the prompt repeats itself: lookup must save target passes
        assert outputs[method].stats.target_forwards < outputs["none"].stats.target_forwards


# ---------- sampled output follows the target's distribution, end to end --------------------------

def exact_two_token_distribution(reference, prompt, params) -> np.ndarray:
    """P(t1, t2 | prompt) of the target with the request's warping, by enumeration."""
    from speculators.sampling import warp

    with torch.no_grad():
        first = warp(reference(torch.tensor([prompt])).logits[0, -1], params).double()
        vocab = first.shape[0]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])
        second = warp(reference(batch).logits[:, -1], params).double()
    return (first[:, None] * second).numpy()


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
def test_rejection_sampled_output_follows_the_target(width):
    """Rejection sampling against the draft's probabilities: chi-square over the 64 cells of (first,
    second) token, 6,000 samples, draft unlike the target."""
    model, reference = tiny_pair(seed=5, vocab_size=8)
    params = SamplingParams(temperature=1.0, top_k=6, seed=11)
    prompt = [1, 2, 3, 4]
    draft = layer_skip_draft(model, 1)
    samples, batch = 6000, 500
    counts = np.zeros((8, 8))
    for start in range(0, samples, batch):
        proposer = DraftModelProposer(ModelRunner(draft, batch, 16), width=width)
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
    assert counts[~keep].sum() == 0  # nothing outside top-k
    expected = exact[keep] / exact[keep].sum() * samples
    assert chisquare(counts[keep], expected).pvalue > 1e-3


def test_per_request_statistics_add_up(tiny_model, plain_outputs):
    model, _ = tiny_model
    outputs = run_engine(model, make_proposer("draft-tree", model, 4), PROMPTS)
    for output in outputs:
        stats = output.stats
        assert stats.target_forwards >= 1 and stats.accepted <= stats.drafted
        assert len(output.token_ids) == stats.accepted + stats.target_forwards  # one bonus or recovered token a pass
        assert sum(stats.accepted_per_position) == stats.accepted
        assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
        assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))
        assert stats.draft_seconds > 0 and stats.verify_seconds > 0 and stats.queue_seconds >= 0
        assert stats.time_to_first_token is not None
