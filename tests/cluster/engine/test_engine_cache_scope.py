"""A request's cache scope through the engine: its drafter is asked with it, and its output is learned
under it (None: not learned at all)."""
from __future__ import annotations

from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.request import GenerationRequest
from speculators.proposers.suffix import SuffixProposer
from tests.conftest import IdTokenizer


class Recording(SuffixProposer):
    def __init__(self):
        super().__init__()
        self.asked: dict[str, set] = {}

    def propose(self, requests):
        for request in requests:
            self.asked.setdefault(request.request_id, set()).add(request.cache_scope)
        return super().propose(requests)


def test_outputs_are_learned_under_their_requests_scope(tiny_model):
    model, _ = tiny_model
    proposer = Recording()
    engine = local_engine(model, IdTokenizer(), proposer, SchedulerConfig(max_sequences=4, max_len=128))
    outputs = engine.generate([
        GenerationRequest("a", [1, 2, 3, 1, 2, 3], max_new_tokens=8, cache_scope="tenant:a"),
        GenerationRequest("private", [4, 5, 6, 4, 5, 6], max_new_tokens=8, cache_scope=None),
        GenerationRequest("everyone", [7, 8, 9, 7, 8, 9], max_new_tokens=8),
    ])
    assert proposer.asked == {"a": {"tenant:a"}, "private": {None}, "everyone": {""}}
    assert set(proposer.outputs.tries) == {"tenant:a", ""}  # the private output was not learned
    assert proposer.outputs.tokens == len(outputs[0].token_ids) + len(outputs[2].token_ids)
