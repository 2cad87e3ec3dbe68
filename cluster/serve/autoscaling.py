"""A speculation-aware Ray Serve autoscaling policy.

Plain `autoscaling_config` scales on ongoing requests per replica. With speculative decoding a
replica's capacity is not fixed: a replica whose verification passes yield E tokens each serves
each of its requests about E times as fast as plain decoding (verification of a small tree costs
about one decode step on a GPU), so it carries about E times the concurrent requests at the same
per-request token rate. This policy divides the load by that effective capacity, and adds a
replica at once while any request waits in a replica's own queue (the engine's KV slots are full).

Replicas report, through `record_autoscaling_stats`: `ongoing` (requests held), `queued` (waiting
for a KV slot) and `tokens_per_step` (new tokens per verification pass over the last interval).
"""
from __future__ import annotations

import math
from typing import Any

DEFAULT_TARGET_ONGOING = 8.0


def desired_replicas(
    ongoing: dict[Any, float],
    queued: dict[Any, float],
    tokens_per_step: dict[Any, float],
    current: int,
    target_ongoing: float,
    max_speedup: float = 4.0,
) -> int:
    """The replica count for the reported load; pure, so it is tested without Ray."""
    load = sum(ongoing.values()) + sum(queued.values())
    speedups = [min(max(value, 1.0), max_speedup) for value in tokens_per_step.values()]
    speedup = sum(speedups) / len(speedups) if speedups else 1.0
    wanted = math.ceil(load / (target_ongoing * speedup)) if load else 0
    if any(value > 0 for value in queued.values()):
        wanted = max(wanted, current + 1)
    return wanted


class SpeculationAwarePolicy:
    """Ray Serve custom policy: `autoscaling_config.policy.policy_function` names this class and
    `policy_kwargs` sets `target_ongoing_requests` (per replica, as for plain decoding) and
    `max_speedup` (a cap on the credit given to speculation)."""

    def __init__(self, target_ongoing_requests: float = DEFAULT_TARGET_ONGOING, max_speedup: float = 4.0):
        self.target_ongoing_requests, self.max_speedup = target_ongoing_requests, max_speedup

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        wanted = desired_replicas(
            metrics.get("ongoing", {}), metrics.get("queued", {}), metrics.get("tokens_per_step", {}),
            ctx.current_num_replicas, self.target_ongoing_requests, self.max_speedup,
        )
        bounded = min(max(wanted, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        return bounded, ctx.policy_state
