"""What the engine counts: per request (returned with its output) and per engine (sampled by metrics)."""
from __future__ import annotations

from collections.abc import Sequence
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
    """accepted_per_position[d]: accepted drafted tokens at depth d + 1 (at most one per step)."""
    drafted_per_position: list[int] = field(default_factory=list)
    """drafted_per_position[d]: drafted tokens at depth d + 1 (a tree may hold several per depth)."""
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    queue_seconds: float = 0.0
    time_to_first_token: float | None = None
    grammar_pruned: int = 0
    """Drafted tokens the request's grammar ruled out before verification (not counted in `drafted`)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV the prefix cache held at admission (not computed again)."""
    preemptions: int = 0
    """Times the KV cache ran out and the request was set back to the queue (resumed from its tokens)."""

    def record(self, drafted_depths: Sequence[int], accepted: int) -> None:
        """One verification pass: the depth of every drafted node (root excluded) and how many were accepted."""
        self.target_forwards += 1
        self.drafted += len(drafted_depths)
        self.accepted += accepted
        for counts, depths in ((self.drafted_per_position, drafted_depths), (self.accepted_per_position, range(1, accepted + 1))):
            for depth in depths:
                counts.extend([0] * (depth - len(counts)))
                counts[depth - 1] += 1

    def mean_accepted_tokens(self, new_tokens: int) -> float:
        return mean_accepted_tokens(new_tokens, self.target_forwards)


@dataclass
class EngineCounters:
    """Running totals of one engine; metrics take differences between samples."""

    steps: int = 0
    verify_seconds: float = 0.0
    draft_wait_seconds: float = 0.0
    draft_failures: int = 0
    draft_calls_skipped: int = 0
    """Steps that did not call a cheap drafter because, at their batch size, its calls cost more than
    they saved (speculation then runs as plain decoding: planner.DraftCallGate)."""
    bad_trees: int = 0
    """Drafted trees dropped before verification (wrong root, tokens outside the vocabulary, ...)."""
    target_failures: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    """Prompt tokens admitted (a resumed request's tokens so far included)."""
    cached_prompt_tokens: int = 0
    """Of those, the tokens the prefix cache held: cached / prompt is the prefix cache's hit rate."""
    preemptions: int = 0
    request_passes: int = 0
    """Verification passes summed over requests (a step of 8 requests counts 8): tokens / request_passes
    is each request's mean accepted tokens per pass, which is what speculation buys it."""
