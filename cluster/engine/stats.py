"""What the engine counts: per request (returned with its output) and per engine (sampled by metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field


def mean_accepted_tokens(new_tokens: int, target_forwards: int) -> float:
    """Tokens gained per verification pass, bonus included (plain decoding = 1.0; 0 before any pass)."""
    return new_tokens / target_forwards if target_forwards else 0.0


@dataclass
class RequestStats:
    target_forwards: int = 0
    """Verification passes of the target (prefill not counted)."""
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """accepted_per_position[d]: steps in which the token at depth d + 1 was accepted."""
    drafted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    queue_seconds: float = 0.0
    time_to_first_token: float | None = None

    def record(self, drafted_depth: int, drafted_nodes: int, accepted: int) -> None:
        self.target_forwards += 1
        self.drafted += drafted_nodes
        self.accepted += accepted
        for counts, upto in ((self.drafted_per_position, drafted_depth), (self.accepted_per_position, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for depth in range(upto):
                counts[depth] += 1

    def mean_accepted_tokens(self, new_tokens: int) -> float:
        return mean_accepted_tokens(new_tokens, self.target_forwards)


@dataclass
class EngineCounters:
    """Running totals of one engine; metrics take differences between samples."""

    steps: int = 0
    verify_seconds: float = 0.0
    draft_wait_seconds: float = 0.0
    draft_failures: int = 0
    target_failures: int = 0
    tokens: int = 0
