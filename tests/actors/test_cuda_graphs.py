"""CUDA graphs at bucketed sizes: the padded, fixed-shape pass they capture computes the plain pass.

On the CPU the flag changes nothing, and the bucketed layout is run eagerly (capture=False) against
the plain pass; on a GPU the captured graphs are replayed against it too.
"""
from __future__ import annotations

import pytest
import torch

from actors.model.cuda_graphs import GraphedForward
from actors.model.runner import ModelRunner
from speculators.proposers.base import TreeInput
from speculators.tree import chain_parents

CALLS = [
    [TreeInput("a", [1, 2, 3, 4, 5], chain_parents(5))],  # 5 tokens: padded to the bucket of 8
    [TreeInput("a", [6, 7, 8], [-1, 0, -1])],  # a tree on top of scratch
    [TreeInput("a", [9], [1], logits="last")],
    [TreeInput("a", [t % 64 for t in range(70)], chain_parents(70))],  # past the largest bucket: eager
    [TreeInput("a", [3], [-1]), TreeInput("b", [4, 5], chain_parents(2))],  # two sequences: eager
]


def run(runner: ModelRunner) -> list[torch.Tensor]:
    for seq_id in ("a", "b"):
        runner.add(seq_id)
    outputs = []
    for index, call in enumerate(CALLS):
        outputs += [row for row in runner.forward(call) if row is not None]
        if index == 2:
            runner.commit("a", [0, 1, 2])
    return outputs


def test_the_bucketed_pass_computes_the_plain_pass(tiny_model):
    model, _ = tiny_model
    expected = run(ModelRunner(model, 2, 160))
    bucketed = ModelRunner(model, 2, 160)
    bucketed._pass = GraphedForward(model, bucketed.cache, capture=False)  # the layout, without capture
    for got, want in zip(run(bucketed), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    buckets = bucketed._pass.buckets  # the first call went through the bucket of 8, padded
    assert buckets[8].input_ids.tolist() == [1, 2, 3, 4, 5, 0, 0, 0] and buckets[1].input_ids.tolist() == [9]


def test_the_flag_changes_nothing_on_a_cpu(tiny_model):
    model, _ = tiny_model
    assert ModelRunner(model, 1, 16, cuda_graphs=True)._pass is model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_graphs_compute_the_plain_pass(tiny_model):
    model, _ = tiny_model
    model = model.to("cuda")
    try:
        expected = run(ModelRunner(model, 2, 160))
        for got, want in zip(run(ModelRunner(model, 2, 160, cuda_graphs=True)), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    finally:
        model.to("cpu")
