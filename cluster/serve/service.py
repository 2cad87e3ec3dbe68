"""The serving core shared by the gRPC and HTTP front ends: limits, auth, routing.

Front ends turn their wire format into `RequestOptions` and build the engine's request as every
entrance does (requests.py, which names a bad field: InvalidRequest -> HTTP 400 / INVALID_ARGUMENT),
then call `stream` or `generate`, which refuse work past the concurrency limit at once (Overloaded
-> HTTP 503 / RESOURCE_EXHAUSTED) instead of queueing without bound.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from cluster.engine.loop import EngineLoop, least_loaded
from cluster.engine.loop import stream as loop_stream
from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.spec_engine import StepEvent
from cluster.serve.limits import ServiceLimits
from cluster.serve.requests import (  # noqa: F401  (front ends and tests import these from here)
    InvalidRequest,
    RequestBuilder,
    RequestOptions,
    SpeculationOptions,
    StructuredOutput,
)
from cluster.serve.samples import Samples
from speculators.lookahead import LookaheadConfig


class Observer(Protocol):
    """Where the service reports what it served (cluster/serve/metrics.py records it for Prometheus)."""

    def chunk(self, tokens: int, seconds_since_last: float) -> None: ...

    def finished(self, output: GenerationOutput, protocol: str) -> None: ...


class Overloaded(RuntimeError):
    """Too many requests in flight: retry later (HTTP 503, gRPC RESOURCE_EXHAUSTED)."""


class Unauthorized(PermissionError):
    """Missing or wrong API key (HTTP 401, gRPC UNAUTHENTICATED)."""


class SpecService(RequestBuilder):
    """Requests built as every entrance builds them (RequestBuilder), run on this replica's engine loops."""

    def __init__(
        self,
        loops: Sequence[EngineLoop],
        tokenizer,
        model_id: str,
        method: str,
        default_lookahead: LookaheadConfig,
        limits: ServiceLimits = ServiceLimits(),
        observer: Observer | None = None,
    ):
        self.loops = list(loops)
        super().__init__(self.loops[0].engine if self.loops else None, tokenizer, model_id, method,
                         default_lookahead, limits)
        self.observer = observer
        self._api_keys = limits.resolved_api_keys()
        self.token_strings  # built now: it parses the whole tokenizer, which on the event loop stalls every stream
        self.in_flight = 0

    # ---- auth -------------------------------------------------------------------------------

    def authorize(self, header_value: str | None) -> str | None:
        """The tenant the presented key names ('Bearer KEY' or the bare key); None on a deployment
        without keys (one tenant, RequestBuilder.tenant)."""
        if self._api_keys is None:
            return None
        tenant = self._api_keys.tenant_of((header_value or "").removeprefix("Bearer ").strip())
        if tenant is None:
            raise Unauthorized("missing or invalid API key")
        return tenant

    # ---- running -------------------------------------------------------------------------------

    def _loop(self, chosen: EngineLoop | None = None) -> EngineLoop:
        """`chosen`, or the least loaded loop, if this replica may take one more request."""
        if self.in_flight >= self.limits.max_concurrent_requests:
            raise Overloaded(f"{self.in_flight} requests in flight; the limit is {self.limits.max_concurrent_requests}")
        return chosen or least_loaded(self.loops)

    async def stream(self, request: GenerationRequest, protocol: str = "http",
                     loop: EngineLoop | None = None) -> AsyncIterator[StepEvent]:
        """The request's step events, from `loop` (the least loaded when None), within the limits."""
        loop = self._loop(loop)
        self.in_flight += 1
        last = time.perf_counter()
        try:
            limit = self.limits.request_timeout_s
            async with contextlib.aclosing(loop_stream(loop, request, limit)) as events:  # abort at once when closed
                async for event in _ending_at_deadline(events, request, limit):
                    if self.observer:
                        now = time.perf_counter()
                        self.observer.chunk(len(event.new_token_ids), now - last)
                        last = now
                        if event.finished:
                            self.observer.finished(event.finished, protocol)
                    yield event
        finally:
            self.in_flight -= 1

    async def stream_samples(self, samples: Samples, protocol: str = "http") -> AsyncIterator[tuple[int, StepEvent]]:
        """(index in samples.requests, event) for every request of a call, interleaved as they come.

        All of them go to one engine loop, so requests admitted together share their prompt's
        prefill. Closing this iterator aborts every request still running.
        """
        if len(samples.requests) == 1:
            async with contextlib.aclosing(self.stream(samples.requests[0], protocol)) as events:
                async for event in events:
                    yield 0, event
            return
        loop, queue = self._loop(), asyncio.Queue()

        async def pump(index: int, request: GenerationRequest) -> None:
            try:
                async with contextlib.aclosing(self.stream(request, protocol, loop)) as events:
                    async for event in events:
                        queue.put_nowait((index, event))
            except Exception as error:  # Overloaded, or a failure: the caller raises it
                queue.put_nowait((index, error))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(samples.requests)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                running -= item.finished is not None
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def generate(self, request: GenerationRequest, protocol: str = "http") -> GenerationOutput:
        async for event in self.stream(request, protocol):
            if event.finished:
                return event.finished
        raise RuntimeError("the engine ended the stream without a final output")

    @property
    def queue_depth(self) -> int:
        return sum(loop.engine.queue_depth for loop in self.loops)


async def _ending_at_deadline(events: AsyncIterator[StepEvent], request: GenerationRequest,
                              limit: float) -> AsyncIterator[StepEvent]:
    """The events; past the request's deadline (the stream raises TimeoutError, having aborted the
    request), a retryable error ends it, so no client waits without bound."""
    try:
        async for event in events:
            yield event
    except TimeoutError:
        reason = f"the request ran past the server's {limit:g} s limit; retry it (perhaps with fewer tokens)"
        yield StepEvent(request.request_id, [], GenerationOutput.refused(request, reason))
