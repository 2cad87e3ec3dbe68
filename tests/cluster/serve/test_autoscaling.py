import threading
from types import SimpleNamespace

from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.request import GenerationRequest
from cluster.serve.autoscaling import SpeculationAwarePolicy, desired_replicas
from cluster.serve.metrics import ServingMetrics
from tests.conftest import IdTokenizer


def test_speculation_raises_each_replicas_capacity():
    load = {"a": 16.0, "b": 16.0}
    plain = desired_replicas(load, {}, {"a": 1.0, "b": 1.0}, current=2, target_ongoing=8)
    speculative = desired_replicas(load, {}, {"a": 2.0, "b": 2.0}, current=2, target_ongoing=8)
    assert (plain, speculative) == (4, 2)


def test_credit_for_speculation_is_capped_and_never_below_plain():
    load = {"a": 64.0}
    assert desired_replicas(load, {}, {"a": 50.0}, 1, 8, max_speedup=4) == 2
    assert desired_replicas(load, {}, {"a": 0.2}, 1, 8) == 8


def test_waiting_for_drafts_lowers_the_credit_for_speculation():
    """A replica gaining 3 tokens a pass whose passes wait for drafts half as long again as they
    verify (a draft pool at its max_drafters) serves each request 2x, not 3x, as fast as plain."""
    load, tokens = {"a": 48.0}, {"a": 3.0}
    assert desired_replicas(load, {}, tokens, 1, target_ongoing=8) == 2
    assert desired_replicas(load, {}, tokens, 1, target_ongoing=8, draft_wait_fraction={"a": 0.5}) == 3
    assert desired_replicas(load, {}, tokens, 1, target_ongoing=8, draft_wait_fraction={"a": 9.0}) == 6  # never below plain


def test_a_replica_reports_how_long_its_passes_wait_for_drafts(monkeypatch):
    from cluster.engine.stats import EngineCounters

    counters = EngineCounters(steps=10, tokens=30, request_passes=10, verify_seconds=2.0, draft_wait_seconds=0.5)
    engine = SimpleNamespace(counters=counters, queue_depth=0, waiting=[], kv_cache_usage=None)
    metrics, loop = ServingMetrics(), SimpleNamespace(engine=engine, load=1)
    assert metrics.sample([loop])["draft_wait_fraction"] == 0.25
    counters.steps, counters.verify_seconds, counters.draft_wait_seconds = 20, 3.0, 1.5
    assert metrics.sample([loop])["draft_wait_fraction"] == 1.0  # this period's: 1 s of waits over 1 s of passes
    assert metrics.sample([loop])["draft_wait_fraction"] == 1.0  # no pass since: the last figure stands


def test_a_long_wait_for_a_kv_slot_adds_a_replica_and_idle_goes_to_zero():
    assert desired_replicas({"a": 4.0}, {"a": 31.0}, {"a": 3.0}, current=1, target_ongoing=8, max_queue_wait_s=30) == 2
    assert desired_replicas({}, {}, {}, current=3, target_ongoing=8) == 0


def test_a_normal_queue_adds_no_replica():
    """The default serve config: 32 requests held, 8 KV slots, so 24 wait a little; 32 / 8 = 4 replicas,
    not one more for the queue (queued requests are part of `ongoing`, so they count once)."""
    assert desired_replicas({"a": 32.0}, {"a": 2.0}, {"a": 1.0}, current=4, target_ongoing=8) == 4


def test_policy_respects_bounds_and_reads_serve_metrics():
    policy = SpeculationAwarePolicy(target_ongoing_requests=4)
    ctx = SimpleNamespace(
        aggregated_metrics={"ongoing": {"r1": 40.0}, "queue_wait_s": {"r1": 0.0}, "tokens_per_step": {"r1": 1.0}},
        current_num_replicas=1, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=5,
        policy_state={},
    )
    assert policy(ctx) == (5, {})
    ctx.aggregated_metrics = {"ongoing": {"r1": 12.0}, "tokens_per_step": {"r1": 3.0}, "draft_wait_fraction": {"r1": 0.5}}
    assert policy(ctx) == (2, {})  # 12 / (4 x 3 / 1.5) = 1.5: without the wait it would be 1
    ctx.aggregated_metrics = {}
    assert policy(ctx) == (1, {})


def sampled_after(metrics: ServingMetrics, engine, requests) -> dict[str, float]:
    loops = [SimpleNamespace(engine=engine, load=0)]
    metrics.sample(loops)
    engine.generate(requests)
    return metrics.sample(loops)


def test_a_batch_without_speculation_reports_one_token_per_pass(tiny_model):
    """8 requests decoded together, no drafter: each gains 1 token per pass, so no credit (it was 8)."""
    engine = local_engine(tiny_model[0], IdTokenizer(), None, SchedulerConfig(max_sequences=8, max_len=128))
    requests = [GenerationRequest(f"r{i}", [i + 1, i + 2, 3], max_new_tokens=6) for i in range(8)]
    assert sampled_after(ServingMetrics(), engine, requests)["tokens_per_step"] == 1.0


def test_samples_from_two_threads_keep_every_token(tiny_model):
    """The event loop and Serve's autoscaling thread both sample: no period may be counted twice."""
    metrics = ServingMetrics()
    engine = local_engine(tiny_model[0], IdTokenizer(), None, SchedulerConfig(max_sequences=4, max_len=128))
    loops = [SimpleNamespace(engine=engine, load=0)]
    seen, stop = [], threading.Event()
    real_sample = metrics._sample

    def counting_sample(loops):
        before = metrics._last.tokens
        result = real_sample(loops)
        seen.append(metrics._last.tokens - before)
        return result

    metrics._sample = counting_sample

    def sampler():
        while not stop.is_set():
            metrics.sample(loops)

    threads = [threading.Thread(target=sampler) for _ in range(2)]
    for thread in threads:
        thread.start()
    engine.generate([GenerationRequest(f"r{i}", [i + 1, 2, 3], max_new_tokens=20) for i in range(4)])
    stop.set()
    for thread in threads:
        thread.join()
    metrics.sample(loops)
    assert sum(seen) == engine.counters.tokens == 80


def test_drafter_and_target_failures_are_counted_once(monkeypatch):
    from types import SimpleNamespace

    from cluster.engine.stats import EngineCounters

    metrics, counted = ServingMetrics(), []
    monkeypatch.setattr(metrics.drafter_failures, "inc", lambda n, tags=None: counted.append((tags["kind"], n)))
    monkeypatch.setattr(metrics.target_failures, "inc", lambda n, tags=None: counted.append(("target", n)))
    counters = EngineCounters(draft_failures=2, bad_trees=1, target_failures=1)
    engine = SimpleNamespace(counters=counters, queue_depth=0, waiting=[], kv_cache_usage=None)
    loop = SimpleNamespace(engine=engine, load=0)
    metrics.sample([loop])
    metrics.sample([loop])  # nothing new: nothing counted again
    counters.draft_failures += 1
    metrics.sample([loop])
    assert counted == [("call", 2), ("bad_tree", 1), ("target", 1), ("call", 1)]
