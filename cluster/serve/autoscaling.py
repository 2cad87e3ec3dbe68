"""A speculation-aware Ray Serve autoscaling policy.

Plain `autoscaling_config` scales on ongoing requests per replica. With speculative decoding a
replica's capacity is not fixed: a replica whose requests gain E tokens per verification pass each
serves each of its requests about E times as fast as plain decoding (verification of a small tree
costs about one decode step on a GPU), so it carries about E times the concurrent requests at the
same per-request token rate. A pass also waits for its drafts: when draft calls queue (a draft pool
at `max_drafters`, a slow draft actor), each pass takes (1 + w) times its verification time, w the
engine's wait for drafts over its verification time, so the credit is E / (1 + w). The draft pool
sizes itself on the same wait, seen from the pool's side (cluster/runtime/pool_sizing.py): the pool
adds drafters while it can, and what it cannot absorb lowers the target replicas' credit here.
This policy divides the load by that effective capacity, and adds a replica at once when a request
has waited for a KV slot longer than `max_queue_wait_s`: a queue is normal (a replica may hold more
requests than it has KV slots), a long wait is not.

Replicas report, through `record_autoscaling_stats`: `ongoing` (requests held, waiting ones
included), `queued` (waiting for a KV slot), `queue_wait_s` (how long the oldest of those has
waited), `tokens_per_step` (new tokens per request per verification pass over the last interval)
and `draft_wait_fraction` (w above, over the same interval).
"""
from __future__ import annotations

import math
from typing import Any

DEFAULT_TARGET_ONGOING = 8.0
DEFAULT_MAX_QUEUE_WAIT_S = 30.0


def desired_replicas(
    ongoing: dict[Any, float],
    queue_wait_s: dict[Any, float],
    tokens_per_step: dict[Any, float],
    current: int,
    target_ongoing: float,
    max_speedup: float = 4.0,
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S,
    draft_wait_fraction: dict[Any, float] | None = None,
) -> int:
    """The replica count for the reported load; pure, so it is tested without Ray."""
    load = sum(ongoing.values())
    waits = draft_wait_fraction or {}
    speedups = [min(max(value / (1.0 + max(waits.get(replica, 0.0), 0.0)), 1.0), max_speedup)
                for replica, value in tokens_per_step.items()]
    speedup = sum(speedups) / len(speedups) if speedups else 1.0
    wanted = math.ceil(load / (target_ongoing * speedup)) if load else 0
    if any(wait > max_queue_wait_s for wait in queue_wait_s.values()):
        wanted = max(wanted, current + 1)
    return wanted


class SpeculationAwarePolicy:
    """Ray Serve custom policy: `autoscaling_config.policy.policy_function` names this class and
    `policy_kwargs` sets `target_ongoing_requests` (per replica, as for plain decoding),
    `max_speedup` (a cap on the credit given to speculation) and `max_queue_wait_s`."""

    def __init__(self, target_ongoing_requests: float = DEFAULT_TARGET_ONGOING, max_speedup: float = 4.0,
                 max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S):
        self.target_ongoing_requests, self.max_speedup = target_ongoing_requests, max_speedup
        self.max_queue_wait_s = max_queue_wait_s

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        wanted = desired_replicas(
            metrics.get("ongoing", {}), metrics.get("queue_wait_s", {}), metrics.get("tokens_per_step", {}),
            ctx.current_num_replicas, self.target_ongoing_requests, self.max_speedup, self.max_queue_wait_s,
            metrics.get("draft_wait_fraction", {}),
        )
        bounded = min(max(wanted, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        return bounded, ctx.policy_state
