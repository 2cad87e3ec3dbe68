"""Waiting on workers with a deadline, and remembering which worker is still stuck in a call.

Workers run calls in order, so a worker whose call outlived its timeout would make every later call
wait behind it: a stalled drafter gets no new work until that call ends (its requests decode
plainly meanwhile), so a hung drafter costs one timeout, not one per step.
"""
from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError  # not the builtin on Python 3.10
from typing import Any


class WorkerTimeout(TimeoutError):
    """A worker did not answer within its deadline."""


def result_within(future: Future, timeout_s: float, what: str) -> Any:
    """The future's result, or WorkerTimeout naming `what` after `timeout_s` seconds."""
    try:
        return future.result(timeout_s)
    except FutureTimeoutError:
        raise WorkerTimeout(f"{what} did not answer within {timeout_s:g} s") from None


class StalledWorkers:
    def __init__(self):
        self._calls: dict[int, Future] = {}

    def add(self, worker: object, future: Future) -> None:
        self._calls[id(worker)] = future

    def is_stalled(self, worker: object) -> bool:
        future = self._calls.get(id(worker))
        if future is not None and future.done():
            del self._calls[id(worker)]
            return False
        return future is not None
