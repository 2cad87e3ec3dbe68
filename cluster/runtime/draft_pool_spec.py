"""The settings of a draft pool (cluster/runtime/draft_pool.py), apart so that ClusterSpec can name
them without importing the pool's Ray code."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DraftPoolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, description="the pool's name: every replica (and target group) naming it "
                      "shares its drafters; replicas of different models must name different pools")
    min_drafters: int = Field(1, ge=1, description="drafters the pool keeps however idle")
    max_drafters: int = Field(1, ge=1, description="drafters the pool may grow to")
    groups_per_drafter: int = Field(
        4, ge=1, description="target groups' worth of requests one drafter keeps state for (its draft model's KV "
        "cache is sized for that many; past it, idle requests' sequences are dropped and rebuilt later)")
    scale_up_wait_fraction: float = Field(
        0.2, gt=0, description="add a drafter when a draft call waits longer than this fraction of a target pass")
    scale_down_wait_fraction: float = Field(
        0.02, ge=0, description="remove one when calls wait less than this fraction, over scale_down_after_s")
    scale_down_after_s: float = Field(120, gt=0, description="how long waits must stay low before a drafter goes")
    report_period_s: float = Field(2, gt=0, description="how often each target group reports its waits and passes")
    idle_shutdown_s: float = Field(60, gt=0, description="the pool ends this long after its last replica detached "
                                   "or stopped reporting")
    member_timeout_s: float = Field(
        2, gt=0, description="longest wait for one drafter's part of a draft call (the other drafters' parts are used "
        "without it: its requests decode plainly that step and draft on the others from the next) and for its "
        "answer to the keeper's health check; below the engine's draft_timeout_s")
    member_misses: int = Field(3, ge=1, description="health checks in a row (one every report_period_s) a drafter may "
                               "leave unanswered past member_timeout_s before the keeper replaces it")

    @model_validator(mode="after")
    def _bounds(self) -> DraftPoolSpec:
        if self.max_drafters < self.min_drafters:
            raise ValueError(f"draft_pool.max_drafters ({self.max_drafters}) is below min_drafters ({self.min_drafters})")
        return self
