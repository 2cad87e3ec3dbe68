"""A prompt's first token comes out of the pass that prefills its last chunk: the request's first
root is verified after the chunk in the same pass, not one pass later."""
from __future__ import annotations

import pytest

from actors.messages import AdmitItem, VerifyItem
from actors.target_worker import TargetWorker
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.request import GenerationRequest
from speculators.proposers.prompt_lookup import PromptLookupProposer
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree
from tests.conftest import IdTokenizer

PROMPT = list(range(3, 23))  # 20 tokens: 19 to prefill, the last is the first root


def passes_to_first_token(engine, request: GenerationRequest) -> tuple[int, list[int]]:
    """Engine steps until the request's first token, and its output."""
    engine.add(request)
    steps, tokens = 0, []
    while engine.has_work:
        events = engine.step()
        steps += 1
        tokens += [t for e in events for t in e.new_token_ids]
        if tokens:
            return steps, tokens
    raise AssertionError("no token came out")


@pytest.mark.parametrize("budget, passes", [(64, 1), (8, 3)], ids=["one-chunk", "three-chunks"])
def test_the_first_token_comes_with_the_last_chunk(tiny_model, budget, passes):
    """19 prompt tokens to prefill: one pass when the budget holds them, three of 8 when it does not;
    the pass carrying the last chunk also gives the first token."""
    model, _ = tiny_model
    config = SchedulerConfig(max_sequences=4, max_len=128, prefill_chunk_tokens=8, max_num_batched_tokens=budget)
    engine = local_engine(model, IdTokenizer(), PromptLookupProposer(), config)
    steps, tokens = passes_to_first_token(engine, GenerationRequest("a", PROMPT, max_new_tokens=4))
    assert steps == passes and len(tokens) == 1


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)], ids=["greedy", "seeded"])
def test_a_first_root_after_its_chunk_decodes_as_after_a_prefill(tiny_model, sampling):
    """Same tokens as the whole-prompt path (prefill, then the root alone in the next pass), greedy
    and seeded: the root's position, which keys the sample, counts the chunk before it."""
    model, _ = tiny_model
    outputs = {}
    for chunk in (None, 8):
        config = SchedulerConfig(max_sequences=4, max_len=128, prefill_chunk_tokens=chunk)
        engine = local_engine(model, IdTokenizer(), PromptLookupProposer(), config)
        requests = [GenerationRequest(f"r{i}", PROMPT[i:], sampling, max_new_tokens=12) for i in range(3)]
        outputs[chunk] = [o.token_ids for o in engine.generate(requests)]
    assert outputs[8] == outputs[None]


def test_a_starting_request_verified_without_its_last_chunk_is_refused(tiny_model):
    """The worker's contract: a request still prefilling is verified only in the pass of the chunk
    that ends its prompt."""
    model, _ = tiny_model
    worker = TargetWorker(model, 2, 128)
    worker.start([AdmitItem("s", PROMPT, SamplingParams())], prefill=False)
    root = [VerifyItem("s", DraftTree.root_only(PROMPT[-1]))]
    with pytest.raises(ValueError, match="before their prompts' last chunk"):
        worker.verify(root)
    with pytest.raises(ValueError, match="leaves 11 to prefill"):
        worker.verify(root, [("s", 8)])
    reply = worker.verify(root, [("s", 19)])
    assert reply.prefill[0].tokens == 19 and reply.results[0].new_tokens
    assert worker.runner.committed_length("s") == len(PROMPT)  # the chunk and the root
