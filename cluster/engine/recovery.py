"""A failed target's rebuild, and what it says of the replica: health apart from readiness.

The rebuild runs on the engine's loop thread, and reloading a large tensor-parallel group from a
volume takes longer than Serve's health checks allow (three failures 10 s apart replace the
replica). So a rebuild under way leaves the engine healthy ("can recover": Serve keeps the replica)
but not ready ("can serve now": `GET /health` 503, gRPC NOT_SERVING, so load balancers send work
elsewhere). Only a rebuild that failed makes it unhealthy, until a later try (every
`rebuild_retry_s`) works.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from actors.worker import Worker

log = logging.getLogger(__name__)


class TargetRecovery:
    def __init__(self, rebuild: Callable[[], Worker] | None, retry_s: float):
        self.rebuild, self.retry_s = rebuild, retry_s
        self.unavailable: str | None = None
        """Why the target cannot serve (it failed and is being rebuilt, or its rebuild failed); None while it serves."""
        self.failed = False
        """Whether the last rebuild failed: the replica may not recover by itself (its health checks fail)."""
        self._next_try = 0.0

    def down(self, error: Exception) -> None:
        self.unavailable = f"{type(error).__name__}: {error}"

    def try_rebuild(self) -> Worker | None:
        """A rebuilt target, or None: not yet time to try again (at most once per retry_s), or this try failed."""
        if time.monotonic() < self._next_try:
            return None
        try:
            target = self.rebuild()
        except Exception as error:
            log.error("rebuilding the target failed: %s; retrying in %g s", error, self.retry_s)
            self.unavailable = f"rebuild failed: {type(error).__name__}: {error}"
            self.failed, self._next_try = True, time.monotonic() + self.retry_s
            return None
        self.unavailable, self.failed = None, False
        return target
