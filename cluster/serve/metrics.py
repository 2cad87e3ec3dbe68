"""Prometheus metrics of a serving replica, through ray.serve.metrics (exported by Ray's metrics agent).

Per request: counts, tokens, time to first token, inter-token latency, drafted and accepted
tokens and acceptance by draft position. Per replica, sampled every `SAMPLE_PERIOD_S`: queue
depth, active requests, mean accepted tokens and the mean draft-wait and verify time of a step
over the last period, prompt tokens admitted and found in the prefix cache, preemptions, draft
calls skipped because they would not pay, and the KV cache blocks in use. The same sample feeds the autoscaling policy.

Mean accepted tokens is counted per request: a pass that verifies 8 requests and gains one token for
each is 1 token per pass (plain decoding), not 8. Samples are taken by the replica's event loop and
by Serve's autoscaling thread, so a lock keeps each period's differences whole.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from ray.serve.metrics import Counter, Gauge, Histogram

from cluster.engine.loop import EngineLoop
from cluster.engine.request import GenerationOutput
from cluster.engine.stats import EngineCounters

SAMPLE_PERIOD_S = 2.0
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

NAMES = {
    "specserve_requests": "requests finished, by finish_reason and protocol",
    "specserve_generated_tokens": "tokens returned to clients",
    "specserve_time_to_first_token_seconds": "arrival to first token",
    "specserve_inter_token_latency_seconds": "time between streamed tokens",
    "specserve_drafted_tokens": "drafted tokens sent to verification",
    "specserve_accepted_tokens": "drafted tokens the target accepted",
    "specserve_accepted_by_position": "accepted drafted tokens by depth in the tree",
    "specserve_drafted_by_position": "drafted tokens by depth in the tree",
    "specserve_mean_accepted_tokens": "new tokens per request per verification pass over the last period",
    "specserve_draft_step_seconds": "mean time a step waited for its drafts over the last period",
    "specserve_verify_step_seconds": "mean time of a verification pass over the last period",
    "specserve_queue_depth": "requests waiting for KV cache room (preempted ones included)",
    "specserve_prompt_tokens": "prompt tokens admitted (a resumed request's tokens so far included)",
    "specserve_cached_prompt_tokens": "admitted prompt tokens whose KV the prefix cache held (the hit rate: "
                                      "this over specserve_prompt_tokens)",
    "specserve_preemptions": "requests set back to the queue because the KV cache ran out (resumed later)",
    "specserve_kv_cache_usage": "fraction of KV cache blocks held by running requests, at the last admission",
    "specserve_active_requests": "requests being decoded",
    "specserve_drafter_failures": "draft calls that failed or timed out (kind=call) and drafted trees dropped as malformed "
                                  "(kind=bad_tree); each costs its requests one plain step",
    "specserve_target_failures": "target worker groups that failed (their requests ended with a retryable error)",
    "specserve_draft_calls_skipped": "steps that did not call the drafter because, at their batch size, its calls "
                                     "cost more than they saved (those steps decode plainly)",
}


class ServingMetrics:
    def __init__(self):
        d = NAMES
        self.requests = Counter("specserve_requests", d["specserve_requests"], tag_keys=("finish_reason", "protocol"))
        self.tokens = Counter("specserve_generated_tokens", d["specserve_generated_tokens"])
        self.ttft = Histogram("specserve_time_to_first_token_seconds", d["specserve_time_to_first_token_seconds"],
                              LATENCY_BUCKETS)
        self.itl = Histogram("specserve_inter_token_latency_seconds", d["specserve_inter_token_latency_seconds"], LATENCY_BUCKETS)
        self.drafted = Counter("specserve_drafted_tokens", d["specserve_drafted_tokens"])
        self.accepted = Counter("specserve_accepted_tokens", d["specserve_accepted_tokens"])
        self.accepted_by_position = Counter("specserve_accepted_by_position", d["specserve_accepted_by_position"],
                                            tag_keys=("position",))
        self.drafted_by_position = Counter("specserve_drafted_by_position", d["specserve_drafted_by_position"],
                                           tag_keys=("position",))
        self.mean_accepted = Gauge("specserve_mean_accepted_tokens", d["specserve_mean_accepted_tokens"])
        self.draft_step = Gauge("specserve_draft_step_seconds", d["specserve_draft_step_seconds"])
        self.verify_step = Gauge("specserve_verify_step_seconds", d["specserve_verify_step_seconds"])
        self.queue_depth = Gauge("specserve_queue_depth", d["specserve_queue_depth"])
        self.active = Gauge("specserve_active_requests", d["specserve_active_requests"])
        self.drafter_failures = Counter("specserve_drafter_failures", d["specserve_drafter_failures"], tag_keys=("kind",))
        self.target_failures = Counter("specserve_target_failures", d["specserve_target_failures"])
        self.draft_calls_skipped = Counter("specserve_draft_calls_skipped", d["specserve_draft_calls_skipped"])
        self.prompt_tokens = Counter("specserve_prompt_tokens", d["specserve_prompt_tokens"])
        self.cached_prompt_tokens = Counter("specserve_cached_prompt_tokens", d["specserve_cached_prompt_tokens"])
        self.preemptions = Counter("specserve_preemptions", d["specserve_preemptions"])
        self.kv_usage = Gauge("specserve_kv_cache_usage", d["specserve_kv_cache_usage"])
        self._last = EngineCounters()
        self._lock = threading.Lock()
        self.latest: dict[str, float] = {"ongoing": 0.0, "queued": 0.0, "queue_wait_s": 0.0, "tokens_per_step": 1.0,
                                          "draft_wait_fraction": 0.0}

    def chunk(self, tokens: int, seconds_since_last: float) -> None:
        if tokens:
            self.tokens.inc(tokens)
            self.itl.observe(seconds_since_last / tokens)

    def finished(self, output: GenerationOutput, protocol: str) -> None:
        self.requests.inc(tags={"finish_reason": output.finish_reason, "protocol": protocol})
        stats = output.stats
        if stats.time_to_first_token is not None:
            self.ttft.observe(stats.time_to_first_token)
        if stats.drafted:
            self.drafted.inc(stats.drafted)
        if stats.accepted:
            self.accepted.inc(stats.accepted)
        for position, count in enumerate(stats.accepted_per_position, start=1):
            if count:
                self.accepted_by_position.inc(count, tags={"position": str(position)})
        for position, count in enumerate(stats.drafted_per_position, start=1):
            if count:
                self.drafted_by_position.inc(count, tags={"position": str(position)})

    def sample(self, loops: Sequence[EngineLoop]) -> dict[str, float]:
        """Update the per-replica gauges; returns the autoscaling stats of the last period."""
        with self._lock:
            return self._sample(loops)

    def _sample(self, loops: Sequence[EngineLoop]) -> dict[str, float]:
        engines = [loop.engine for loop in loops]
        now = EngineCounters(
            steps=sum(e.counters.steps for e in engines), tokens=sum(e.counters.tokens for e in engines),
            request_passes=sum(e.counters.request_passes for e in engines),
            verify_seconds=sum(e.counters.verify_seconds for e in engines),
            draft_wait_seconds=sum(e.counters.draft_wait_seconds for e in engines),
            draft_failures=sum(e.counters.draft_failures for e in engines),
            draft_calls_skipped=sum(e.counters.draft_calls_skipped for e in engines),
            bad_trees=sum(e.counters.bad_trees for e in engines),
            target_failures=sum(e.counters.target_failures for e in engines),
            prompt_tokens=sum(e.counters.prompt_tokens for e in engines),
            cached_prompt_tokens=sum(e.counters.cached_prompt_tokens for e in engines),
            preemptions=sum(e.counters.preemptions for e in engines),
        )
        for counter, tags, change in ((self.drafter_failures, {"kind": "call"}, now.draft_failures - self._last.draft_failures),
                                      (self.drafter_failures, {"kind": "bad_tree"}, now.bad_trees - self._last.bad_trees),
                                      (self.target_failures, None, now.target_failures - self._last.target_failures),
                                      (self.draft_calls_skipped, None,
                                       now.draft_calls_skipped - self._last.draft_calls_skipped),
                                      (self.prompt_tokens, None, now.prompt_tokens - self._last.prompt_tokens),
                                      (self.cached_prompt_tokens, None,
                                       now.cached_prompt_tokens - self._last.cached_prompt_tokens),
                                      (self.preemptions, None, now.preemptions - self._last.preemptions)):
            if change > 0:
                counter.inc(change, tags=tags)
        steps = now.steps - self._last.steps
        passes = now.request_passes - self._last.request_passes
        tokens_per_step = (now.tokens - self._last.tokens) / passes if passes else self.latest["tokens_per_step"]
        verify_s = now.verify_seconds - self._last.verify_seconds
        draft_wait_s = now.draft_wait_seconds - self._last.draft_wait_seconds
        draft_wait_fraction = draft_wait_s / verify_s if verify_s > 0 else self.latest["draft_wait_fraction"]
        if steps:
            self.mean_accepted.set(tokens_per_step)
            self.verify_step.set(verify_s / steps)
            self.draft_step.set(draft_wait_s / steps)
        queued = sum(e.queue_depth for e in engines)
        ongoing = sum(loop.load for loop in loops)
        self.queue_depth.set(queued)
        usage = [e.kv_cache_usage for e in engines if e.kv_cache_usage is not None]
        if usage:
            self.kv_usage.set(sum(usage) / len(usage))
        self.active.set(ongoing - queued)
        self._last = now
        self.latest = {"ongoing": float(ongoing), "queued": float(queued),
                       "queue_wait_s": max((_longest_wait(e) for e in engines), default=0.0),
                       "tokens_per_step": float(tokens_per_step), "draft_wait_fraction": float(draft_wait_fraction)}
        return self.latest


def _longest_wait(engine) -> float:
    """Seconds the oldest request waiting for KV cache room has waited (read from another thread: one
    indexing of the deque, which the GIL keeps whole)."""
    try:
        return time.perf_counter() - engine.waiting[0].arrival_time
    except IndexError:
        return 0.0
