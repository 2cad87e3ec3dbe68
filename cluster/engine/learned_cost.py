"""Costs learned from what calls actually took, fitted online by least squares with forgetting, so
they follow a machine whose load changes: a costly drafter's call (a draft model's, a trained
head's), and a whole verification step against the target's measured cost curve."""
from __future__ import annotations

import numpy as np

from cluster.engine.cost import CostCurve

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


STEP_MEMORY = 0.99
"""Weight an earlier step keeps at each new one: the step fit follows about the last 100 steps (a few
seconds), long enough to average out a noisy step, short enough to follow a change of load."""
PRIOR_STEPS = 2.0
"""Steps' worth of belief that the cost curve is right, before and beside what steps say."""


class StepCost:
    """Seconds of a verification step as the engine lives it, not as the startup cost curve timed it.

    The curve times bare forward passes on a quiet machine. A served step also pays what the curve
    never sees: the tree's verification (the target's choice at every node, KV compaction),
    committing and streaming, and the serving path's threads on the same cores. Steps are fitted
    online as the curve plus a correction, `fixed + scale * curve + per_drafted * drafted`, shrunk
    towards no correction (PRIOR_STEPS): a drafted token may cost more than a prompt token of the
    same pass, and a served step more than a timed one. Every coefficient is kept non-negative (the
    fit is solved as non-negative least squares): the curve is the fastest each pass ran, so a step
    only ever adds to it, and a step that ran faster (a shorter context than the curve's) never
    makes drafted tokens look cheaper than the curve says.
    """

    def __init__(self, curve: CostCurve):
        self.curve = curve
        self._unit = curve.seconds(1)
        self._per_token = curve.seconds_per_token()
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self._ridge = PRIOR_STEPS * np.diag(np.array([self._unit, self._unit, self._per_token]) ** 2)
        self._fixed, self._scale, self._per_drafted = 0.0, 0.0, 0.0
        """The fitted correction in seconds, as plain floats: `seconds` runs for every node a trim weighs."""

    def _features(self, forward: float, drafted: int) -> np.ndarray:
        """In seconds; the prior holds each coefficient near zero at the scale of a pass (a step's part)
        or of a token (a drafted token's part)."""
        return np.array([self._unit, forward, drafted * self._per_token])

    def observe(self, tokens: int, sequences: int, drafted: int, seconds: float) -> None:
        """A step of `tokens` tokens (drafted ones and prompt chunks included) over `sequences` took `seconds`."""
        forward = self.curve.seconds(tokens, sequences)
        x = self._features(forward, drafted)
        self._xx = STEP_MEMORY * self._xx + np.outer(x, x)
        self._xy = STEP_MEMORY * self._xy + x * (seconds - forward)
        fixed, scale, per_drafted = _non_negative_solve(self._xx + self._ridge, self._xy)
        self._fixed, self._scale = float(fixed) * self._unit, float(scale)
        self._per_drafted = float(per_drafted) * self._per_token

    def seconds(self, tokens: int, sequences: int = 1, drafted: int = 0) -> float:
        """Expected seconds of a step of `tokens` tokens over `sequences`, `drafted` of them drafted
        (the curve plus the correction over `_features`, in plain arithmetic)."""
        forward = self.curve.seconds(tokens, sequences)
        return forward + self._fixed + self._scale * forward + self._per_drafted * drafted


def _non_negative_solve(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """argmin over w >= 0 of w' gram w - 2 moment' w (gram positive definite): the best of the
    unconstrained solutions over each subset of the coefficients that come out non-negative; three
    coefficients make eight subsets."""
    size = len(moment)
    best, best_value = np.zeros(size), 0.0
    for subset in range(1, 2 ** size):
        free = [i for i in range(size) if subset >> i & 1]
        part = np.linalg.solve(gram[np.ix_(free, free)], moment[free])
        if (part < 0).any():
            continue
        candidate = np.zeros(size)
        candidate[free] = part
        value = candidate @ gram @ candidate - 2 * moment @ candidate
        if value < best_value:
            best, best_value = candidate, value
    return best
