"""A generation request as the engine sees it, its running statistics and its final output."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from speculators.lookahead import LookaheadConfig
from speculators.sampling import SamplingParams


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    speculate: bool = True
    lookahead: LookaheadConfig | None = None
    """None: the engine's default."""
    arrival_time: float = field(default_factory=time.perf_counter)


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
        """Tokens gained per verification pass, bonus included (plain decoding = 1.0)."""
        return new_tokens / self.target_forwards if self.target_forwards else 0.0


@dataclass
class GenerationOutput:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    """'stop' (EOS or a stop string), 'length' (max_new_tokens or the context window), 'abort', 'error'."""
    stats: RequestStats
    seconds: float
    """From admission (prefill included) to the last token."""
    error: str | None = None
    """Why the request failed (finish_reason 'error'); such errors are retryable."""

    @property
    def mean_accepted_tokens(self) -> float:
        return self.stats.mean_accepted_tokens(len(self.token_ids))
