"""Faults inside one engine: a poisoned request, bad or hung drafters, a hung or unrebuildable target,
and a loop whose listeners misbehave. Each must cost only what it touches."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from actors.draft_worker import DraftWorker
from actors.messages import AdmissionRefused
from actors.target_worker import TargetWorker
from actors.worker import LocalWorker
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.loop import EngineLoop
from cluster.engine.request import GenerationRequest
from cluster.engine.spec_engine import TARGET_FAILED, TARGET_UNAVAILABLE, SpecEngine
from cluster.engine.stats import RequestStats
from speculators.proposers.prompt_lookup import PromptLookupProposer
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree
from tests.conftest import IdTokenizer, wait_until_loop_idle

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [3] * 12, list(range(10, 40))]
NEW_TOKENS = 16
CONFIG = SchedulerConfig(max_sequences=4, max_len=256)


def requests(prefix: str = "r", sampling: SamplingParams = SamplingParams()) -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}{i}", p, sampling, NEW_TOKENS) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Plain greedy decoding: what every request that survives must still produce."""
    return [o.token_ids for o in local_engine(tiny_model[0], IdTokenizer(), None, CONFIG).generate(requests())]


def nan_sampling() -> SamplingParams:
    """What validation now refuses, smuggled past it: the request that used to fail its whole group."""
    params = SamplingParams(0.7, seed=1)
    object.__setattr__(params, "temperature", float("nan"))
    return params


def test_a_request_whose_verification_raises_fails_alone(tiny_model, plain):
    engine = local_engine(tiny_model[0], IdTokenizer(), PromptLookupProposer(), CONFIG)
    batch = requests()
    batch[1].sampling = nan_sampling()
    outputs = engine.generate(batch)
    assert outputs[1].finish_reason == "error" and "verification failed" in outputs[1].error
    assert [o.token_ids for i, o in enumerate(outputs) if i != 1] == [p for i, p in enumerate(plain) if i != 1]
    assert engine.counters.target_failures == 0 and not engine.has_work
    assert [o.token_ids for o in engine.generate(requests("again"))] == plain  # its slot was freed


class CorruptingProposer(PromptLookupProposer):
    """Prompt lookup, except that request r1 always gets a bad tree of the given kind."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def propose(self, draft_requests):
        trees = super().propose(draft_requests)
        for index, request in enumerate(draft_requests):
            if request.request_id == "r1":
                trees[index] = self.bad_tree(request.token_ids[-1])
        return trees

    def bad_tree(self, root: int):
        if self.kind == "root":
            return DraftTree.chain(root + 1, [4, 5])
        if self.kind == "vocabulary":
            return DraftTree.chain(root, [10 ** 6])
        if self.kind == "parents":
            tree = DraftTree.chain(root, [4, 5])
            tree.parents = [-1, 2, 0]  # what an unpickled tree can carry: no constructor ran
            return tree
        if self.kind == "probabilities":
            return DraftTree.chain(root, [4], draft_probs=torch.full((2, 64), float("nan")))
        if self.kind == "size":
            return DraftTree.chain(root, [4] * 300)
        return "not a tree"


@pytest.mark.parametrize("kind", ["root", "vocabulary", "parents", "probabilities", "size", "type"])
def test_a_bad_tree_costs_only_its_requests_proposals(tiny_model, plain, kind):
    engine = local_engine(tiny_model[0], IdTokenizer(), CorruptingProposer(kind), CONFIG)
    outputs = engine.generate(requests())
    assert [o.token_ids for o in outputs] == plain
    assert engine.counters.bad_trees > 0 and engine.counters.target_failures == 0
    assert outputs[1].stats.drafted == 0 and sum(o.stats.accepted for o in outputs) > 0


class Blocking:
    """Wraps a worker; its first call to `method` waits until `release` is set."""

    def __init__(self, inner, method: str):
        self.inner, self.method, self.release, self.calls = inner, method, threading.Event(), 0

    def __getattr__(self, name):
        attribute = getattr(self.inner, name)
        if name != self.method:
            return attribute

        def call(*args):
            self.calls += 1
            if self.calls == 1:
                self.release.wait(30)
            return attribute(*args)

        return call


def test_a_hung_drafter_costs_one_wait_then_plain_steps(tiny_model, plain):
    drafter = Blocking(DraftWorker(PromptLookupProposer), "propose")
    model = tiny_model[0]
    config = CONFIG.model_copy(update={"draft_timeout_s": 0.2})
    engine = SpecEngine(LocalWorker(TargetWorker(model, 4, 256)), IdTokenizer(), [LocalWorker(drafter, threaded=True)], config,
                        vocab_size=64)
    try:
        outputs = engine.generate(requests())
    finally:
        drafter.release.set()
    assert [o.token_ids for o in outputs] == plain
    assert engine.counters.draft_failures == 1 and drafter.calls == 1  # no second call queued behind the hung one


def failing_target(model, method: str):
    """A target worker whose first `method` call raises."""
    worker = TargetWorker(model, 4, 256)
    real, calls = getattr(worker, method), []

    def call(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected collective failure")
        return real(*args)

    setattr(worker, method, call)
    return worker


def test_a_hung_verification_fails_the_group_and_it_is_rebuilt(tiny_model, plain):
    model = tiny_model[0]
    hung = Blocking(TargetWorker(model, 4, 256), "verify")
    config = CONFIG.model_copy(update={"target_timeout_s": 0.3})
    engine = SpecEngine(LocalWorker(hung, threaded=True), IdTokenizer(), [], config, vocab_size=64,
                        rebuild_target=lambda: LocalWorker(TargetWorker(model, 4, 256)))
    try:
        failed = engine.generate(requests("hung"))
    finally:
        hung.release.set()
    assert all(o.finish_reason == "error" and TARGET_FAILED in o.error for o in failed)
    assert [o.token_ids for o in engine.generate(requests())] == plain


def answer(loop: EngineLoop, request: GenerationRequest) -> Future:
    future: Future = Future()
    loop.submit(request, lambda event: event.finished and future.set_result(event.finished))
    return future


def test_a_failed_rebuild_answers_every_request_and_fails_health_until_a_rebuild_works(tiny_model, plain):
    model, attempts = tiny_model[0], []

    def rebuild():
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("no GPUs left for a new group")
        return LocalWorker(TargetWorker(model, 4, 256))

    config = CONFIG.model_copy(update={"rebuild_retry_s": 0.5})
    engine = SpecEngine(LocalWorker(failing_target(model, "verify")), IdTokenizer(), [], config, vocab_size=64,
                        rebuild_target=rebuild)
    loop = EngineLoop(engine, "rebuild-test")
    try:
        first = answer(loop, requests("a")[0]).result(30)
        assert first.finish_reason == "error" and TARGET_FAILED in first.error
        refused = answer(loop, requests("b")[0]).result(30)  # answered at once, not left waiting
        assert refused.finish_reason == "error" and TARGET_UNAVAILABLE in refused.error
        assert not loop.alive and not loop.ready  # a failed rebuild fails the replica's health check too
        threading.Event().wait(0.6)
        recovered = [answer(loop, r) for r in requests()]
        assert [f.result(60).token_ids for f in recovered] == plain
        assert loop.alive and loop.ready and len(attempts) == 2
    finally:
        loop.stop()


def test_a_listener_that_raises_does_not_stop_the_loop(tiny_model, plain):
    loop = EngineLoop(local_engine(tiny_model[0], IdTokenizer(), PromptLookupProposer(), CONFIG), "listener-test")
    try:
        def broken(event):
            raise RuntimeError("the client's event loop is closed")

        batch = requests()
        loop.submit(batch[0], broken)
        futures = [answer(loop, r) for r in batch[1:]]
        assert [f.result(60).token_ids for f in futures] == plain[1:]
        assert loop.alive
        wait_until_loop_idle(loop)
        assert loop.load == 0 and not loop.engine.has_work  # the abandoned request was aborted
    finally:
        loop.stop()


def test_a_request_the_engine_cannot_take_is_answered(tiny_model, monkeypatch):
    loop = EngineLoop(local_engine(tiny_model[0], IdTokenizer(), None, CONFIG), "add-test")
    try:
        monkeypatch.setattr(loop.engine, "add", lambda request: (_ for _ in ()).throw(KeyError("bug")))
        output = answer(loop, requests()[0]).result(30)
        assert output.finish_reason == "error" and loop.alive and loop.load == 0
    finally:
        loop.stop()


def test_drafted_by_position_counts_tokens_and_passes_count_per_request(tiny_model):
    stats = RequestStats()
    stats.record([1, 1, 1, 2, 3], accepted=2)
    stats.record([1], accepted=0)
    assert (stats.drafted_per_position, stats.accepted_per_position) == ([4, 1, 1], [1, 1])
    assert (stats.drafted, stats.accepted, stats.target_forwards) == (6, 2, 2)
    engine = local_engine(tiny_model[0], IdTokenizer(), None, CONFIG)
    engine.generate(requests())
    assert engine.counters.tokens == engine.counters.request_passes == len(PROMPTS) * NEW_TOKENS


class DeadTarget:
    """What a killed shard looks like to the engine: every call fails."""

    def submit(self, method, *args, **kwargs):
        future: Future = Future()
        future.set_exception(RuntimeError("The actor died unexpectedly before finishing this task."))
        return future


def test_a_target_that_dies_during_a_prefill_is_rebuilt_without_burning_the_queue(tiny_model, plain):
    model, rebuilds = tiny_model[0], []

    def rebuild():
        rebuilds.append(1)
        return LocalWorker(TargetWorker(model, 2, 256))

    engine = SpecEngine(DeadTarget(), IdTokenizer(), [], CONFIG.model_copy(update={"max_sequences": 2}),
                        vocab_size=64, rebuild_target=rebuild)
    outputs = engine.generate(requests())
    assert [o.finish_reason for o in outputs] == ["error", "error", "length", "length"]
    assert all(TARGET_FAILED in o.error for o in outputs[:2]) and rebuilds == [1]
    assert [o.token_ids for o in outputs[2:]] == plain[2:]


def test_a_prefill_the_worker_refuses_fails_only_its_requests(tiny_model, plain):
    worker = TargetWorker(tiny_model[0], 4, 256)
    real_start = worker.start

    def start(batch, **kwargs):
        if any(item.request_id == "r1" for item in batch):
            raise AdmissionRefused("request 'r1' refused")
        return real_start(batch, **kwargs)

    worker.start = start
    engine = SpecEngine(LocalWorker(worker), IdTokenizer(), [], CONFIG.model_copy(update={"max_sequences": 1}),
                        vocab_size=64, rebuild_target=lambda: pytest.fail("a refusal is no target failure"))
    outputs = engine.generate(requests())
    assert outputs[1].finish_reason == "error" and "prefill failed" in outputs[1].error
    assert [o.token_ids for i, o in enumerate(outputs) if i != 1] == [p for i, p in enumerate(plain) if i != 1]
