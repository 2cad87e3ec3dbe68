"""Lookahead policies: how far the drafter runs ahead for one request, chosen per request.

`depth()` bounds how many tokens deep this step drafts; `confidence_threshold` (confidence rule)
stops a branch as soon as the drafter's probability of its own token falls below it; `observe()`
learns from what the target accepted.

Public names follow vLLM and transformers where they have one: `num_speculative_tokens` (vLLM) is
the most tokens drafted ahead in a step, `assistant_confidence_threshold` (transformers) is accepted
for the confidence threshold and `num_assistant_tokens` for the heuristic's starting lookahead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import AliasChoices, BaseModel, Field

PolicyName = Literal["fixed", "heuristic", "confidence"]


class LookaheadConfig(BaseModel):
    """Per-request lookahead; the defaults of the confidence rule are DISCO's."""

    policy: PolicyName = Field("confidence", description="fixed, heuristic (+2 / -1) or confidence threshold")
    num_speculative_tokens: int = Field(
        20, ge=0, le=64, validation_alias=AliasChoices("num_speculative_tokens", "max_tokens"),
        description="most tokens drafted ahead in one step (fixed: exactly this many); alias max_tokens")
    initial_tokens: int = Field(
        5, ge=1, le=64, validation_alias=AliasChoices("initial_tokens", "num_assistant_tokens"),
        description="heuristic: starting lookahead; alias num_assistant_tokens")
    confidence_threshold: float = Field(
        0.4, ge=0.0, le=1.0,
        validation_alias=AliasChoices("confidence_threshold", "threshold", "assistant_confidence_threshold"),
        description="confidence: stop a branch below this draft probability; aliases threshold, "
                    "assistant_confidence_threshold")


@dataclass
class LookaheadPolicy:
    num_speculative_tokens: int
    confidence_threshold: float = 0.0
    current: int = 0
    adaptive: bool = False

    def depth(self) -> int:
        return self.current

    def observe(self, drafted_depth: int, accepted: int) -> None:
        """Heuristic rule (transformers' assisted generation): +2 when all were accepted, else -1."""
        if not self.adaptive or drafted_depth == 0:
            return
        step = 2 if accepted >= drafted_depth else -1
        self.current = max(1, min(self.num_speculative_tokens, self.current + step))


def make_policy(config: LookaheadConfig) -> LookaheadPolicy:
    cap = config.num_speculative_tokens
    if config.policy == "fixed":
        return LookaheadPolicy(cap, current=cap)
    if config.policy == "heuristic":
        return LookaheadPolicy(cap, current=min(config.initial_tokens, cap), adaptive=True)
    return LookaheadPolicy(cap, confidence_threshold=config.confidence_threshold, current=cap)
