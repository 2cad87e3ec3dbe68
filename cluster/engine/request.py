"""A generation request as the engine sees it, and its final output."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.engine.stats import RequestStats
from speculators.logprobs import TokenLogprob
from speculators.lookahead import LookaheadConfig
from speculators.penalties import Penalties
from speculators.sampling import SamplingParams

if TYPE_CHECKING:
    from cluster.engine.grammar import CompiledGrammar


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
    penalties: Penalties | None = None
    logprobs: int | None = None
    """Alternatives wanted at each output position (0: the chosen token's log-probability only); None: none."""
    grammar: CompiledGrammar | None = None
    """What the output must match (structured output); None: anything. (A front end's request holds its
    grammar's `Compiling` until the front end has awaited it, cluster/serve/requests.py `await_grammars`.)"""
    cache_scope: str | None = ""
    """Whose earlier outputs suffix decoding may draft from, and under which scope this request's
    output is learned: the same scope only ("": one scope for everyone, as in-process runs have;
    the server gives each tenant its own, cluster/serve/requests.py). None: nothing shared (only the
    request's own text is matched, and its output is not learned)."""


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
    finish_detail: str | None = None
    """Which limit ended a 'length' output: max_new_tokens, or the context window (max_len)."""
    logprobs: list[TokenLogprob] | None = None
    """One per output token, when the request asked for them."""

    @classmethod
    def refused(cls, request: GenerationRequest, reason: str) -> GenerationOutput:
        """The output of a request the engine would not take."""
        return cls(request_id=request.request_id, token_ids=[], text="", finish_reason="error", stats=RequestStats(), seconds=0.0,
                   error=reason)

    @property
    def mean_accepted_tokens(self) -> float:
        return self.stats.mean_accepted_tokens(len(self.token_ids))
