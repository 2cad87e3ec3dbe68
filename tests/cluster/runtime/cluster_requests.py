"""Requests shared by the cluster test modules, and the plain decoding they must equal."""
from __future__ import annotations

import threading

import pytest

from actors.model.loader import load_model
from cluster.engine.build import local_engine
from cluster.engine.request import GenerationRequest
from speculators.lookahead import LookaheadConfig
from tests.conftest import IdTokenizer

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [3] * 12, list(range(10, 40))]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    """Plain greedy decoding in this process: what every cluster output must equal."""
    engine = local_engine(load_model(tiny_model_dir), IdTokenizer(), None)
    return [o.token_ids for o in engine.generate(requests())]


SPECULATE = LookaheadConfig(policy="fixed", num_speculative_tokens=4)
"""Four tokens ahead: with the planner off (UNPLANNED), what every step drafts."""
UNPLANNED = {"step_token_budget": 64}
"""EngineConfig fields that turn the planner off by configuration, so trees are verified as drafted:
these tests check drafting through actors, not what pays at this machine's measured cost."""


def requests(prefix="r", max_new_tokens=NEW_TOKENS):
    return [GenerationRequest(f"{prefix}{i}", p, max_new_tokens=max_new_tokens, lookahead=SPECULATE)
            for i, p in enumerate(PROMPTS)]


def run_while(cluster, action, prefix, max_new_tokens=NEW_TOKENS * 4):
    """Start requests, run `action` once the first tokens have streamed, collect the outputs."""
    started, done, outputs = threading.Event(), threading.Event(), {}

    def on_event(event):
        started.set()
        if event.finished:
            outputs[event.request_id] = event.finished
            if len(outputs) == len(PROMPTS):
                done.set()

    loop = cluster.loops[0]
    for request in requests(prefix, max_new_tokens):
        loop.submit(request, on_event)
    assert started.wait(60)
    action()
    assert done.wait(180)
    return [outputs[f"{prefix}{i}"] for i in range(len(PROMPTS))]
