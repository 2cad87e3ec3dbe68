"""The hidden states a trained head reads: captured as transformers numbers them, and returned by
prefill and verification for exactly the tokens committed."""
from __future__ import annotations

import torch

from actors.messages import AdmitItem, VerifyItem
from actors.model.runner import ModelRunner
from actors.target_worker import TargetWorker
from speculators.proposers.base import TreeInput
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree, chain_parents

LAYERS = 4


def full_pass(model, tokens, capture):
    runner = ModelRunner(model, 1, 128)
    runner.add("s")
    _, (rows,) = runner.forward_capturing([TreeInput("s", tokens, chain_parents(len(tokens)), logits="none")], capture)
    return rows


def test_captured_layers_are_transformers_hidden_states(tiny_model):
    model, reference = tiny_model
    tokens = [3, 17, 42, 5, 9, 1, 60]
    capture = (0, 2, LAYERS - 1, LAYERS)
    rows = full_pass(model, tokens, capture)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    assert rows.shape == (len(tokens), len(capture) * 32)
    for index, layer in enumerate(capture):  # entering layer i; the last is the normed final output
        assert torch.allclose(rows[:, index * 32:(index + 1) * 32], expected[layer][0], atol=1e-10)


def test_prefill_and_verification_return_the_committed_tokens_rows(tiny_model):
    model, _ = tiny_model
    capture = (1, 2, LAYERS)
    worker = TargetWorker(model, 2, 128, hidden_layers=capture, hidden_dtype=torch.float32)
    prompt = [3, 17, 42, 5, 9]
    prefill = worker.start([AdmitItem(request_id="a", tokens=prompt, sampling=SamplingParams())]).hidden["a"]
    assert prefill.dtype == torch.float32 and prefill.shape == (len(prompt) - 1, 3 * 32)
    greedy = worker.verify([VerifyItem("a", DraftTree.root_only(prompt[-1]))]).results[0]
    first = greedy.next_token
    tree = DraftTree([first, 11, 12, 13], [-1, 0, 0, 1])  # the target's choices decide what is kept
    result = worker.verify([VerifyItem("a", tree)]).results[0]
    committed = prompt + [first] + result.accepted_tokens
    reference = full_pass(model, committed, capture).float()
    assert torch.allclose(prefill, reference[: len(prompt) - 1], atol=1e-6)
    assert torch.allclose(greedy.hidden, reference[len(prompt) - 1: len(prompt)], atol=1e-6)
    assert result.hidden.shape[0] == len(result.accepted_nodes)
    assert torch.allclose(result.hidden, reference[len(prompt): len(committed)], atol=1e-6)


def test_a_target_without_a_head_sends_nothing(tiny_model):
    model, _ = tiny_model
    worker = TargetWorker(model, 1, 64)
    assert worker.start([AdmitItem(request_id="a", tokens=[1, 2, 3], sampling=SamplingParams())]).hidden is None
    assert worker.verify([VerifyItem("a", DraftTree.root_only(3))]).results[0].hidden is None
