"""One calling convention for workers wherever they live: `submit(method, *args) -> Future`.

The workers of this package (TargetWorker, DraftWorker) are plain classes; the engine drives them
through this convention, so the same scheduling code runs the in-process CLI (LocalWorker: a
one-thread executor, which also lets a draft overlap a verify) and the Ray cluster (RayActorWorker
for draft actors; target_group.TargetGroup for a tensor-parallel target, which has the same method).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol


class Worker(Protocol):
    def submit(self, method: str, *args: Any) -> Future: ...


class LocalWorker:
    def __init__(self, target: Any, name: str = "worker"):
        self.target = target
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, method: str, *args: Any) -> Future:
        return self._executor.submit(getattr(self.target, method), *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RayActorWorker:
    """A Ray actor handle; calls from one caller run in submission order on the actor."""

    def __init__(self, actor: Any):
        self.actor = actor

    def submit(self, method: str, *args: Any) -> Future:
        return getattr(self.actor, method).remote(*args).future()

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor)
