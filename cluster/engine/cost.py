"""The cost curve of a target: seconds of a verification pass by tokens in the pass and sequences.

Measured once per target group at start (a few shapes, the fastest of several runs each: other
work on the machine only ever adds time) and cached on disk per model, dtype, device, parallelism,
machine and decoder code (a faster kernel makes an old curve wrong), so later starts read it. The scheduler reads it as
T(tokens, sequences) = f(tokens) + g(sequences): f from single-sequence passes, interpolated
linearly between measured points; g, the extra cost of spreading the tokens over more sequences
(attention over more caches, padding), from multi-sequence passes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

import actors.model
import actors.target_worker
from actors.model.loader import cache_root
from actors.worker import Worker

log = logging.getLogger(__name__)

TOKEN_POINTS = (1, 2, 4, 8, 16, 32, 64)
SEQUENCE_POINTS = (2, 4, 8, 16)
DECODER_CODE = Path(actors.model.__file__).parent
TIMED_WORKER = Path(actors.target_worker.__file__)
CONTEXT = 256
REPEATS = 7


@dataclass(frozen=True)
class CostPoint:
    tokens: int
    sequences: int
    seconds: float


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), xs ascending; linear extrapolation past the ends."""
    if len(xs) == 1:
        return ys[0]
    index = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class CostCurve:
    def __init__(self, points: Sequence[CostPoint]):
        single = sorted((p for p in points if p.sequences == 1), key=lambda p: p.tokens)
        if not single:
            raise ValueError("a cost curve needs single-sequence points")
        self.points = list(points)
        # non-decreasing in tokens: a measured dip (noise, or a kernel that prefers a size) never
        # makes a larger pass look cheaper than a smaller one
        self._tokens, self._seconds = [p.tokens for p in single], []
        for point in single:
            self._seconds.append(max([point.seconds, *self._seconds[-1:]]))
        spread = {}
        for point in points:
            if point.sequences > 1:
                spread.setdefault(point.sequences, []).append(point.seconds - self._single(point.tokens))
        self._sequences = [1, *sorted(spread)]
        self._spread = [0.0, *(max(0.0, sum(v) / len(v)) for _, v in sorted(spread.items()))]

    def _single(self, tokens: float) -> float:
        return max(_interpolate(self._tokens, self._seconds, tokens), self._seconds[0])

    def seconds(self, tokens: int, sequences: int = 1) -> float:
        """Estimated seconds of a verification pass of `tokens` tokens over `sequences` sequences."""
        extra = _interpolate(self._sequences, self._spread, sequences) if sequences > 1 else 0.0
        return self._single(tokens) + max(0.0, extra)

    def seconds_per_token(self) -> float:
        """What one more token adds to a long single-sequence pass (a prompt chunk's rate): the slope
        between the two largest measured passes, extrapolated beyond them."""
        if len(self._tokens) == 1:
            return self._seconds[0] / self._tokens[0]
        slope = (self._seconds[-1] - self._seconds[-2]) / (self._tokens[-1] - self._tokens[-2])
        return slope if slope > 0 else self._seconds[-1] / self._tokens[-1]

    def describe(self) -> str:
        return ", ".join(f"{t} tokens {s * 1000:.1f} ms" for t, s in zip(self._tokens, self._seconds))

    def to_json(self) -> list[dict]:
        return [{"tokens": p.tokens, "sequences": p.sequences, "seconds": p.seconds} for p in self.points]

    @classmethod
    def from_json(cls, rows: list[dict]) -> CostCurve:
        return cls([CostPoint(int(r["tokens"]), int(r["sequences"]), float(r["seconds"])) for r in rows])


def shapes_for(max_sequences: int, max_len: int) -> tuple[list[tuple[int, int]], int]:
    """The (tokens, sequences) shapes worth timing for this engine, and the context length to use."""
    tokens = [t for t in TOKEN_POINTS if t < max_len // 2]
    shapes = [(t, 1) for t in tokens]
    for sequences in (s for s in SEQUENCE_POINTS if s <= max_sequences):
        shapes += [(sequences, sequences), (4 * sequences, sequences)]
    return shapes, max(1, min(CONTEXT, max_len - max(t for t, _ in shapes) - 1))


def curves_folder() -> Path:
    """Where measured curves are kept: $SPECSERVE_COST_CURVES, else the cache's cost-curves folder.
    Delete a file there to measure that target again."""
    return Path(os.environ.get("SPECSERVE_COST_CURVES") or cache_root() / "cost-curves")


def cache_key(*parts: object) -> str:
    """A file name for a curve: the target and everything about this machine and this code that
    changes its speed."""
    machine = (platform.processor() or platform.machine(), os.cpu_count(), torch.get_num_threads(), torch.__version__)
    text = json.dumps([*map(str, parts), *map(str, machine), decoder_fingerprint()])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@cache
def decoder_fingerprint() -> str:
    """A hash of the code a pass runs (the decoder package and the worker that times it): a curve
    measured before a kernel changed is not read after."""
    digest = hashlib.sha1()
    for path in sorted(DECODER_CODE.glob("*.py")) + sorted((DECODER_CODE / "kernels").glob("*.[ch]*")) + [TIMED_WORKER]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def measure(target: Worker, max_sequences: int, max_len: int, key: str | None = None,
            repeats: int = REPEATS) -> CostCurve:
    """The target's cost curve: read from the cache under `key`, else timed on the target and cached."""
    path = None if key is None else curves_folder() / f"{key}.json"
    if path is not None and path.exists():
        try:
            return CostCurve.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as error:
            log.warning("ignoring unreadable cost curve %s: %s", path, error)
    shapes, context = shapes_for(max_sequences, max_len)
    seconds = target.submit("time_passes", shapes, context, repeats).result()
    curve = CostCurve([CostPoint(t, s, sec) for (t, s), sec in zip(shapes, seconds)])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(curve.to_json()))
        partial.replace(path)
    log.info("cost curve of a verification pass: %s", curve.describe())
    return curve
