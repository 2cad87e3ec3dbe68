"""Costs learned from what calls actually took: a costly drafter's call (a draft model's, a trained
head's), as a linear model fitted online by least squares with forgetting (`OnlineFit`), so it
follows a machine whose load changes."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


MEMORY = 0.95
"""Weight an earlier call keeps at each new one: the fit follows about the last 20 calls."""


class OnlineFit:
    """y = coefficients . x, by least squares with forgetting, pulled towards `prior` by
    `prior_weight` pseudo-observations; coefficients are kept non-negative (no cost falls as a
    call does more)."""

    def __init__(self, prior: Sequence[float], prior_weight: float, memory: float = MEMORY):
        self.prior, self.prior_weight, self.memory = np.asarray(prior, float), prior_weight, memory
        self._xx = np.zeros((len(prior), len(prior)))
        self._xy = np.zeros(len(prior))
        self.observations = 0

    def observe(self, x: Sequence[float], y: float) -> None:
        x = np.asarray(x, float)
        self._xx = self.memory * self._xx + np.outer(x, x)
        self._xy = self.memory * self._xy + x * y
        self.observations += 1

    def coefficients(self) -> np.ndarray:
        prior = self.prior_weight * np.eye(len(self.prior))
        return np.linalg.solve(self._xx + prior, self._xy + prior @ self.prior).clip(min=0.0)


class DrafterCost:
    """A costly drafter's seconds per call: `fixed + per_row * rows + per_depth * depth`.

    `rows` are the tokens the drafter catches up on (a request's whole prompt on its first call, the
    tokens committed since its last call afterwards) and `depth` how deep it drafts. The split
    matters: a trained head's first call reads every prompt token, and charging that to its depth
    made drafting look dear enough that the planner stopped the head for good.
    """

    def __init__(self):
        self.fit = OnlineFit([0.0, 0.0, 0.0], prior_weight=1e-9)  # only to solve fits of calls that never varied

    def observe(self, rows: int, depth: int, seconds: float) -> None:
        self.fit.observe([1.0, rows, depth], seconds)

    def coefficients(self) -> tuple[float, float, float]:
        """(fixed, per_row, per_depth) seconds; all zero before the first call."""
        fixed, per_row, per_depth = self.fit.coefficients()
        return float(fixed), float(per_row), float(per_depth)

    def seconds(self, rows: float, depth: int) -> float:
        fixed, per_row, per_depth = self.coefficients()
        return fixed + per_row * rows + per_depth * depth
