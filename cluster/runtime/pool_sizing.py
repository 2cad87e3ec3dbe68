"""How big a draft pool should be (cluster/runtime/draft_pool.py): the rule alone, without Ray, so
that it can be read and tested apart from the keeper that applies it.

The signal is the time a draft call waits (queue and transfer: its round trip less the drafter's own
work) against the time of the target's verification pass, both reported by the pool's clients every
`report_period_s`. A period in which the clients reported and made no draft call counts as no wait,
so an idle pool shrinks.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.runtime.draft_pool_spec import DraftPoolSpec


@dataclass
class Window:
    """Waits and passes reported since the pool last decided its size."""

    reports: int = 0
    calls: int = 0
    wait_s: float = 0.0
    passes: int = 0
    pass_s: float = 0.0

    def add(self, calls: int, wait_s: float, passes: int, pass_s: float) -> None:
        self.reports += 1
        self.calls, self.wait_s = self.calls + calls, self.wait_s + wait_s
        self.passes, self.pass_s = self.passes + passes, self.pass_s + pass_s

    def wait_fraction(self) -> float | None:
        """Mean wait of a draft call over mean target pass: 0 when clients reported no call (idle);
        None when nobody reported, or calls came without target passes to compare them with."""
        if not self.reports:
            return None
        if not self.calls:
            return 0.0
        if not self.passes or self.pass_s <= 0:
            return None
        return (self.wait_s / self.calls) / (self.pass_s / self.passes)


def decide_size(size: int, fraction: float | None, spec: DraftPoolSpec, low_since: float | None,
                now: float) -> tuple[int, float | None]:
    """The pool's next size and since when waits have been low: one drafter more when calls wait
    too long, one fewer when they have waited little for scale_down_after_s."""
    if fraction is None:
        return size, low_since
    if fraction > spec.scale_up_wait_fraction and size < spec.max_drafters:
        return size + 1, None
    if fraction >= spec.scale_down_wait_fraction:
        return size, None
    low_since = now if low_since is None else low_since
    if now - low_since >= spec.scale_down_after_s and size > spec.min_drafters:
        return size - 1, None
    return size, low_since
