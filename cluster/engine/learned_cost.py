"""Costs learned from what calls actually took: a costly drafter's call (a draft model's, a trained
head's), fitted online by least squares with forgetting, so it follows a machine whose load changes."""
from __future__ import annotations

import numpy as np

MEMORY = 0.95
"""Weight an earlier call keeps at each new one: the fit follows about the last 20 calls."""
RIDGE = 1e-9
"""Only to solve a fit of calls that never varied."""


class DrafterCost:
    """A costly drafter's seconds per call: `fixed + per_row * rows + per_depth * depth`.

    `rows` are the tokens the drafter catches up on (a request's whole prompt on its first call, the
    tokens committed since its last call afterwards) and `depth` how deep it drafts. The split
    matters: a trained head's first call reads every prompt token, and charging that to its depth
    made drafting look dear enough that the planner stopped the head for good. Coefficients are
    kept non-negative: no cost falls as a call does more.
    """

    def __init__(self):
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)

    def observe(self, rows: int, depth: int, seconds: float) -> None:
        x = np.array([1.0, rows, depth])
        self._xx = MEMORY * self._xx + np.outer(x, x)
        self._xy = MEMORY * self._xy + x * seconds

    def coefficients(self) -> tuple[float, float, float]:
        """(fixed, per_row, per_depth) seconds; all zero before the first call."""
        fixed, per_row, per_depth = np.linalg.solve(self._xx + RIDGE * np.eye(3), self._xy).clip(min=0.0)
        return float(fixed), float(per_row), float(per_depth)

    def seconds(self, rows: float, depth: int) -> float:
        fixed, per_row, per_depth = self.coefficients()
        return fixed + per_row * rows + per_depth * depth
