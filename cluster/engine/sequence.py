"""One request being decoded: its tokens, speculation state, stats and text, and the rules that end it
(EOS, max_new_tokens, the context window, a stop string)."""
from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.engine.constraints import RequestRules
from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.stats import RequestStats
from cluster.engine.text import OutputText
from speculators.logprobs import TokenLogprob
from speculators.tree import DraftTree

if TYPE_CHECKING:  # speculation.py, which makes it, imports this module
    from cluster.engine.speculation import RequestSpeculation


@dataclass
class ActiveRequest:
    request: GenerationRequest
    speculation: RequestSpeculation
    """Its lookahead, acceptance gate and acceptance factor (cluster/engine/speculation.py)."""
    group: int
    """The micro-batch it is verified in (always 0 without pipelining)."""
    text: OutputText
    tokens: list[int] = field(default_factory=list)
    """Everything committed: prompt and output."""
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
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

    def pruned(self, tree: DraftTree) -> DraftTree:
        """The tree without drafted tokens the request's grammar rules out (counted in its stats)."""
        if self.rules is None:
            return tree
        tree, pruned = self.rules.prune(tree)
        self.stats.grammar_pruned += pruned
        return tree

    def fail(self, reason: str) -> None:
        self.finish_reason, self.error = "error", reason

    def final_output(self) -> GenerationOutput:
        seconds = time.perf_counter() - self.started
        return GenerationOutput(request_id=self.request_id, token_ids=self.output, text=self.text.text(),
                                finish_reason=self.finish_reason, stats=self.stats, seconds=seconds, error=self.error,
                                finish_detail=self.finish_detail,
                                logprobs=None if self.request.logprobs is None else self.logprobs)
