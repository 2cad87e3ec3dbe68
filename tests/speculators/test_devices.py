"""Where random streams and draft probabilities live when the models run on a GPU.

torch samples only with a generator of the tensor's own device, so a request's generator must be
made where its logits are; whatever leaves an actor (draft trees, results) must be on the CPU.
The CPU suite checks the plumbing (which device each generator is asked for, what crosses);
`bench/gpu_check.py` runs the same paths on CUDA.
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from actors.messages import AdmitItem, VerifyItem
from actors.model.runner import ModelRunner
from actors.target_worker import TargetWorker
from speculators.proposers.base import DraftRequest
from speculators.proposers.draft_model import DraftModelProposer
from speculators.sampling import DraftNoise, SamplingParams
from speculators.tree import DraftTree
from speculators.verify import verify

SAMPLED = SamplingParams(temperature=1.0, seed=7, rule="rejection")
"""The rule that draws from a seeded torch.Generator (keyed requests draw no generator)."""
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def generator_devices(monkeypatch):
    """The device every SamplingParams.generator call asked for."""
    asked = []
    real = SamplingParams.generator

    def recording(self, salt=0, device=None):
        asked.append(None if device is None else torch.device(device))
        return real(self, salt) if device is None else real(self, salt, device)

    monkeypatch.setattr(SamplingParams, "generator", recording)
    return asked


def test_a_generator_is_made_on_the_device_it_is_asked_for():
    generator = SAMPLED.generator(3, torch.device("cpu"))
    assert generator.device == torch.device("cpu")
    again = SAMPLED.generator(3, "cpu")
    assert torch.equal(torch.rand(4, generator=generator), torch.rand(4, generator=again))


@needs_cuda
def test_a_cuda_generator_samples_cuda_probabilities():
    generator = SAMPLED.generator(0, "cuda")
    probs = torch.tensor([0.1, 0.9], device="cuda")
    assert generator.device.type == "cuda"
    assert torch.multinomial(probs, 1, generator=generator).device.type == "cuda"


def test_the_draft_model_samples_with_a_generator_on_its_logits_device(tiny_model, generator_devices):
    model, _ = tiny_model
    proposer = DraftModelProposer(ModelRunner(model, 2, 64), width=2)
    tree = proposer.propose([DraftRequest("r", [1, 2, 3], 3, 6, sampling=SAMPLED)])[0]
    assert generator_devices == [model.device]
    assert tree.num_drafted > 0
    assert tree.draft_probs.device.type == "cpu"  # the tree leaves the draft actor


def test_the_target_verifies_with_a_generator_on_its_model_device(tiny_model, generator_devices):
    model, _ = tiny_model
    worker = TargetWorker(model, 2, 64)
    worker.start([AdmitItem(request_id="sampled", tokens=[1, 2, 3], sampling=SAMPLED),
                  AdmitItem(request_id="greedy", tokens=[4, 5], sampling=SamplingParams())])
    assert generator_devices == [model.device]  # greedy requests draw nothing
    results = worker.verify([VerifyItem("sampled", DraftTree.chain(3, [9, 4]))]).results
    assert all(isinstance(token, int) for token in results[0].new_tokens)


def test_verification_takes_draft_probabilities_in_another_dtype_than_the_target():
    """Draft rows arrive as the draft's float32 on the CPU; the verifier moves each visited row
    next to the target's probabilities (float64 here; on a GPU, to the GPU)."""
    vocab = 5
    q = torch.full((3, vocab), 1 / vocab, dtype=torch.float32)
    tree = DraftTree.chain(0, [1, 2], q)
    logits = torch.zeros(3, vocab, dtype=torch.float64)
    result = verify(tree, logits, SAMPLED, SAMPLED.generator(0))
    assert 0 <= result.next_token < vocab


@pytest.mark.parametrize("rule", ["rejection", "keyed"])
def test_sampling_without_replacement_follows_successive_draws(rule):
    """First draw ~ q; second draw ~ q renormalised without the first (chi-square on both), with a
    stream (one per request, 8000 steps) or with keyed noise (8000 seeds)."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    if rule == "keyed":
        draws = torch.stack([DraftNoise(SamplingParams(1.0, seed=s), 5).draw(q, 2, 1) for s in range(8000)])
    else:
        noise = DraftNoise(SamplingParams(1.0, seed=0, rule="rejection"), 5)
        draws = torch.stack([noise.draw(q, 2, 1) for _ in range(8000)])
    assert bool((draws[:, 0] != draws[:, 1]).all())
    first = torch.bincount(draws[:, 0], minlength=4).double()
    assert chisquare(first.numpy(), (q * len(draws)).numpy()).pvalue > 1e-3
    seconds = draws[draws[:, 0] == 0, 1]  # after drawing token 0, the rest in proportion
    expected = q[1:] / q[1:].sum() * len(seconds)
    assert chisquare(torch.bincount(seconds, minlength=4)[1:].double().numpy(), expected.numpy()).pvalue > 1e-3


def test_draws_past_the_support_of_q_are_dropped_from_the_tree(tiny_model):
    """top_k=1 leaves one token with q > 0: a width-3 root gets one child, not three."""
    model, _ = tiny_model
    proposer = DraftModelProposer(ModelRunner(model, 2, 64), width=3)
    sampling = SamplingParams(temperature=1.0, top_k=1, seed=1, rule="rejection")
    tree = proposer.propose([DraftRequest("r", [1, 2, 3], 1, 6, sampling=sampling)])[0]
    assert tree.parents == [-1, 0]
    assert float(tree.draft_probs[1, tree.token_ids[1]]) == 1.0
