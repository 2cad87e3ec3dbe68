"""What the target worker adds for the API's features: a prompt's computed blocks reused by a later
one, shaped verification (penalties, grammar masks) and logprobs read from the same pass."""
from __future__ import annotations

import torch

from actors.messages import AdmitItem, VerifyItem
from actors.target_worker import CacheOptions, TargetWorker
from speculators.penalties import Penalties, PenaltyContext
from speculators.proposers.base import TreeInput
from speculators.sampling import SamplingParams
from speculators.shaping import Shaping
from speculators.tree import DraftTree

PROMPT = [3, 7, 1, 9, 4, 4, 2]
GREEDY = SamplingParams()


def test_a_prompt_admitted_later_reuses_the_computed_blocks_of_an_identical_one(tiny_model):
    model, _ = tiny_model
    worker = TargetWorker(model, max_sequences=4, max_len=64, cache=CacheOptions(block_size=4, prefix_caching=True))
    passes = []
    real_forward = worker.runner.forward_capturing
    worker.runner.forward_capturing = lambda inputs, capture=(): (passes.append([len(i.token_ids) for i in inputs])
                                                                  or real_forward(inputs, capture))
    worker.start([AdmitItem(request_id="a", tokens=PROMPT, sampling=GREEDY, cache_scope=""),
                  AdmitItem(request_id="c", tokens=[5, 6, 2], sampling=GREEDY, cache_scope="")])
    admission = worker.start([AdmitItem(request_id="b", tokens=PROMPT, sampling=GREEDY, cache_scope=""),
                              AdmitItem(request_id="d", tokens=PROMPT, sampling=GREEDY, cache_scope="other scope")])
    assert passes == [[len(PROMPT) - 1, 2], [2, len(PROMPT) - 1]]  # b finds a's full block of 4; d is not a's tenant
    assert admission.cached_tokens == {"b": 4, "d": 0}
    alone = TargetWorker(model, max_sequences=1, max_len=64)
    alone.start([AdmitItem(request_id="x", tokens=PROMPT, sampling=GREEDY)])
    tree = DraftTree([2, 8, 8], [-1, 0, 1])
    expected = alone.runner.forward([TreeInput("x", tree.token_ids, tree.parents)])[0]
    for seq_id in "abd":
        assert worker.runner.committed_length(seq_id) == len(PROMPT) - 1
        logits = worker.runner.forward([TreeInput(seq_id, tree.token_ids, tree.parents)])[0]
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        worker.runner.truncate(seq_id, len(PROMPT) - 1)


def test_logprobs_come_from_the_verification_pass(tiny_model):
    model, reference = tiny_model
    worker = TargetWorker(model, max_sequences=1, max_len=64)
    worker.start([AdmitItem(request_id="s", tokens=PROMPT, sampling=GREEDY)])
    tree = DraftTree([2, 9, 9, 1], [-1, 0, 1, 2])
    result = worker.verify([VerifyItem("s", tree, Shaping(logprobs=3))]).results[0]
    sequence = PROMPT + result.new_tokens[:-1]
    with torch.no_grad():
        logits = reference(torch.tensor([sequence])).logits[0, len(PROMPT) - 1:].double()
    expected = logits.log_softmax(-1)
    assert [e.token for e in result.logprobs] == result.new_tokens
    for row, entry in zip(expected, result.logprobs):
        assert abs(entry.logprob - float(row[entry.token])) < 1e-5
        top = row.topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert all(abs(lp - v) < 1e-5 for (_, lp), v in zip(entry.top, top.values.tolist()))
    assert result.logprobs[0].top[0][0] == result.new_tokens[0]  # greedy: the chosen token is the likeliest


def test_greedy_with_penalties_takes_the_penalised_argmax(tiny_model):
    model, reference = tiny_model
    worker = TargetWorker(model, max_sequences=1, max_len=64)
    worker.start([AdmitItem(request_id="s", tokens=PROMPT, sampling=GREEDY)])
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT])).logits[0, -1].double()
    top = int(logits.argmax())
    penalties = Penalties(repetition=1.0, presence=2.0, frequency=2.0)
    context = PenaltyContext(penalties, PROMPT + [top], len(PROMPT))  # the likeliest token already in the output
    result = worker.verify([VerifyItem("s", DraftTree.root_only(PROMPT[-1]), Shaping(penalties=context))]).results[0]
    penalised = logits.clone()
    penalised[top] -= 4.0
    assert result.next_token == int(penalised.argmax()) != top
