"""One calling convention for workers wherever they live: `submit(method, *args, **kwargs) -> Future`.

The workers of this package (TargetWorker, DraftWorker) are plain classes; the engine drives them
through this convention, so the same scheduling code runs the in-process CLI (LocalWorker) and the
Ray cluster (RayActorWorker for draft actors; target_group.TargetGroup for a tensor-parallel target,
which has the same method). Methods are named by string (as Ray's are); what a target's calls carry
is typed in messages.py.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Worker(Protocol):
    def submit(self, method: str, *args: Any, **kwargs: Any) -> Future: ...


def tell(worker: Worker, method: str, *args: Any) -> None:
    """A call whose answer nobody waits for; a dead worker must not stop the request from ending."""
    try:
        worker.submit(method, *args)
    except Exception as error:
        log.warning("could not send %s to a worker: %s", method, error)


class LocalWorker:
    """A worker in this process. Its calls run in the caller's thread, already done when `submit`
    returns: torch's OpenMP thread pools belong to the thread that uses them, and on a CPU a second
    thread that has ever run torch work slows both (a decode step of the model loaded or run on
    another thread is much slower; figures: docs/benchmarks.md, "Measurements behind the code"). With
    `threaded`, calls run in order on a thread of their own instead, so a hung worker cannot block
    its caller (what the engine's timeouts are tested with)."""

    def __init__(self, target: Any, name: str = "worker", threaded: bool = False):
        self.target = target
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if threaded else None

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Future:
        call = getattr(self.target, method)
        if self._executor is not None:
            return self._executor.submit(call, *args, **kwargs)
        future: Future = Future()
        try:
            future.set_result(call(*args, **kwargs))
        except BaseException as error:  # the caller learns of it from the future, as from a thread
            future.set_exception(error)
        return future

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


class RayActorWorker:
    """A Ray actor handle; calls from one caller run in submission order on the actor."""

    def __init__(self, actor: Any):
        self.actor = actor

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Future:
        return getattr(self.actor, method).remote(*args, **kwargs).future()

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor)
