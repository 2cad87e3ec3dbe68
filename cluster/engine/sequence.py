"""One request being decoded: its tokens, lookahead, acceptance gate, stats and text, and the rules
that end it (EOS, max_new_tokens, the context window, a stop string)."""
from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from cluster.engine.constraints import RequestRules
from cluster.engine.planner import RequestAcceptance
from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.stats import RequestStats
from cluster.engine.text import OutputText
from speculators.logprobs import TokenLogprob
from speculators.lookahead import LookaheadPolicy


MAX_COOLOFF_DOUBLINGS = 4
"""A gate that keeps closing waits at most 2**4 = 16 times its base cooloff between retries."""


@dataclass
class SpeculationGate:
    """Switches speculation off for a request whose drafts keep being rejected, then retries.

    Tracks an exponential average of the fraction of drafted depth the target accepted; once closed
    it stays closed for `cooloff_steps` steps. Every retry pays `warmup_steps` drafted steps, so a
    retry that fails again doubles the wait (up to MAX_COOLOFF_DOUBLINGS times): a drafter that
    never fits a request costs it a few steps, not one in three. A retry that stays open for
    `cooloff_steps` drafted steps resets the wait.
    """

    min_acceptance: float
    warmup_steps: int
    cooloff_steps: int
    average: float = 1.0
    drafted_steps: int = 0
    off_for: int = 0
    failed_retries: int = 0

    @property
    def is_open(self) -> bool:
        return self.off_for == 0

    def observe(self, drafted_depth: int, accepted: int) -> None:
        """Called once per step of the request."""
        if self.off_for > 0:
            self.off_for -= 1
            return
        if drafted_depth == 0:
            return
        self.drafted_steps += 1
        self.average = 0.7 * self.average + 0.3 * (accepted / drafted_depth)
        if self.drafted_steps < self.warmup_steps:
            return
        if self.average < self.min_acceptance:
            self.off_for = self.cooloff_steps * 2 ** min(self.failed_retries, MAX_COOLOFF_DOUBLINGS)
            self.failed_retries += 1
            self.average, self.drafted_steps = 1.0, 0
        elif self.drafted_steps >= self.cooloff_steps:  # open long enough: the retry held
            self.failed_retries = 0


@dataclass
class ActiveRequest:
    request: GenerationRequest
    policy: LookaheadPolicy
    gate: SpeculationGate
    group: int
    """The micro-batch it is verified in (always 0 without pipelining)."""
    text: OutputText
    tokens: list[int] = field(default_factory=list)
    """Everything committed: prompt and output."""
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    acceptance: RequestAcceptance = field(default_factory=RequestAcceptance)
    started: float = field(default_factory=time.perf_counter)
    finish_reason: str | None = None
    finish_detail: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per output token, when the request asks for them."""
    rules: RequestRules | None = None
    """Its penalties, grammar and logprobs (None: it asks for none)."""
    prefill_left: int = 0
    """Prompt tokens still to prefill (chunked prefill), before it decodes."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def append(self, tokens: list[int], eos_token_ids: Collection[int], max_len: int,
               logprobs: list[TokenLogprob] | None = None) -> tuple[list[int], str]:
        """Commit accepted tokens (with their `logprobs`, when the request wants them) up to EOS,
        max_new_tokens, the context window or a stop string.

        Returns the tokens kept and the text now safe to send.
        """
        if self.stats.time_to_first_token is None:
            self.stats.time_to_first_token = time.perf_counter() - self.request.arrival_time
        new = []
        for token in tokens:
            new.append(token)
            if token in eos_token_ids:
                self.finish_reason = "stop"
                break
            if len(self.output) + len(new) >= self.request.max_new_tokens:
                self.finish_reason, self.finish_detail = "length", f"max_new_tokens ({self.request.max_new_tokens}) reached"
                break
        if self.finish_reason is None and len(self.tokens) + len(new) >= max_len:
            self.finish_reason = "length"
            self.finish_detail = (f"the context window of {max_len} tokens is full ({len(self.request.prompt_ids)} "
                                  f"prompt tokens + {len(self.output) + len(new)} new) before max_new_tokens")
        before = len(self.output)
        self.output.extend(new)
        self.tokens.extend(new)
        if logprobs is not None:
            self.logprobs.extend(logprobs[:len(new)])
        update = self.text.add(new)
        if update.stopped:  # the text ends before a stop string: drop the tokens past it
            excess = len(self.output) - len(self.text.tokens)
            del self.output[len(self.output) - excess:], self.tokens[len(self.tokens) - excess:]
            del self.logprobs[len(self.output):]
            self.finish_reason = "stop"
        return self.output[before:], update.text

    def fail(self, reason: str) -> None:
        self.finish_reason, self.error = "error", reason

    def final_output(self) -> GenerationOutput:
        seconds = time.perf_counter() - self.started
        return GenerationOutput(self.request_id, self.output, self.text.text(), self.finish_reason,
                                self.stats, seconds, self.error, self.finish_detail,
                                None if self.request.logprobs is None else self.logprobs)
