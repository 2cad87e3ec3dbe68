"""Lookahead policies: how far the drafter runs ahead for one request, chosen per request.

`depth()` bounds how many tokens deep this step drafts; `threshold` (confidence rule) stops a
branch as soon as the drafter's probability of its own token falls below it; `observe()` learns
from what the target accepted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

PolicyName = Literal["fixed", "heuristic", "confidence"]


class LookaheadConfig(BaseModel):
    """Per-request lookahead; the defaults of the confidence rule are DISCO's."""

    policy: PolicyName = Field("confidence", description="fixed, heuristic (+2 / -1) or confidence threshold")
    max_tokens: int = Field(20, ge=0, le=64, description="most tokens drafted ahead in one step")
    initial_tokens: int = Field(5, ge=1, le=64, description="heuristic: starting lookahead")
    threshold: float = Field(0.4, ge=0.0, le=1.0, description="confidence: stop a branch below this draft probability")


@dataclass
class LookaheadPolicy:
    max_tokens: int
    threshold: float = 0.0
    current: int = 0
    adaptive: bool = False

    def depth(self) -> int:
        return self.current

    def observe(self, drafted_depth: int, accepted: int) -> None:
        """Heuristic rule (transformers' assisted generation): +2 when all were accepted, else -1."""
        if not self.adaptive or drafted_depth == 0:
            return
        step = 2 if accepted >= drafted_depth else -1
        self.current = max(1, min(self.max_tokens, self.current + step))


def make_policy(config: LookaheadConfig) -> LookaheadPolicy:
    if config.policy == "fixed":
        return LookaheadPolicy(config.max_tokens, current=config.max_tokens)
    if config.policy == "heuristic":
        start = min(config.initial_tokens, config.max_tokens)
        return LookaheadPolicy(config.max_tokens, current=start, adaptive=True)
    return LookaheadPolicy(config.max_tokens, threshold=config.threshold, current=config.max_tokens)
