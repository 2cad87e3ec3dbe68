"""Runs a SpecEngine on its own thread, so callers (the CLI, a Serve replica) only submit and listen.

The engine itself is single-threaded: every call into it happens on the loop thread. Other threads
hand requests and aborts over through a queue; each request's step events come back through the
callback given with it (called on the loop thread: keep it short, e.g. hand over to asyncio).
`stream` hands a step's events to an asyncio loop in one call a step, not one an event: each
hand-over wakes that loop's thread, which takes a core from the pass's threads and the GIL from the
engine's (served at 32 streams, ~8,000 wake-ups a round).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from functools import partial

from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.spec_engine import SpecEngine, StepEvent

log = logging.getLogger(__name__)
EventCallback = Callable[[StepEvent], None]


class EngineLoop:
    def __init__(self, engine: SpecEngine | Callable[[], SpecEngine], name: str = "engine"):
        """`engine`, or a function that builds it: called first thing on the loop's thread, and its
        error raised here. A target in this process is built that way, because torch work on a CPU
        runs fastest on the one thread that loaded and runs the model (actors/worker.py LocalWorker)."""
        build = None if isinstance(engine, SpecEngine) else engine
        self.engine: SpecEngine = engine if build is None else None
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, EventCallback] = {}
        self._held = 0
        self._held_lock = threading.Lock()
        self._handoffs: dict[asyncio.AbstractEventLoop, _Handoff] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(build,), name=name, daemon=True)
        self._built: Future = Future()
        self._thread.start()
        self._built.result()  # the build's error, raised in the caller's thread

    @property
    def alive(self) -> bool:
        """Health: the thread runs and its engine can recover (only a failed rebuild of its target says not)."""
        return self._thread.is_alive() and self.engine.healthy

    @property
    def ready(self) -> bool:
        """Readiness: alive, and its target serves now (not while it is rebuilt)."""
        return self.alive and self.engine.ready

    @property
    def load(self) -> int:
        """Requests submitted and not finished: a router sends new work to the loop with the least."""
        return self._held

    def handoff(self, running: asyncio.AbstractEventLoop) -> _Handoff:
        """The hand-over of step events to the asyncio loop `running`, one a loop."""
        with self._held_lock:
            return self._handoffs.setdefault(running, _Handoff(running))

    def _count(self, change: int) -> None:
        with self._held_lock:
            self._held += change

    def submit(self, request: GenerationRequest, on_event: EventCallback) -> None:
        """Queue a request; invalid ones are refused here, in the caller's thread."""
        self.engine.validate(request)
        self._count(+1)
        self._inbox.put(("add", request, on_event))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout_s)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while True:
            kind, payload, callback = item
            if kind == "add":
                self._add(payload, callback)
            elif kind == "abort":
                self._abort(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: GenerationRequest, callback: EventCallback) -> None:
        try:
            self.engine.add(request)
        except Exception as error:
            self._count(-1)
            _notify(callback, StepEvent(request.request_id, [], GenerationOutput.refused(request, str(error))))
            return
        self._callbacks[request.request_id] = callback

    def _abort(self, request_id: str) -> None:
        callback = self._callbacks.pop(request_id, None)
        output = self.engine.abort(request_id)
        if callback:
            self._count(-1)
            if output:
                _notify(callback, StepEvent(request_id, [], output))

    def _run(self, build: Callable[[], SpecEngine] | None) -> None:
        if build is not None:
            try:
                self.engine = build()
            except BaseException as error:
                self._built.set_exception(error)
                return
        self._built.set_result(None)
        while not self._stopping.is_set():
            try:  # nothing may end this thread but stop(): a dead loop hangs every client
                self._turn()
            except Exception:
                log.exception("engine loop failed outside a step")
                self._deliver(self.engine.fail_all("internal engine error"))
            finally:
                self._hand_over()

    def _turn(self) -> None:
        self._drain_inbox(block=not self.engine.has_work)
        if not self.engine.has_work:
            return
        try:
            events = self.engine.step()
        except Exception:  # a bug must not silently kill the loop and hang every client
            log.exception("engine step failed")
            events = self.engine.fail_all("internal engine error")
        self._deliver(events)

    def _hand_over(self) -> None:
        with self._held_lock:
            handoffs = list(self._handoffs.items())
        for running, handoff in handoffs:
            lost = handoff.flush()
            if lost is None and not running.is_closed():
                continue
            with self._held_lock:  # that asyncio loop is closed: nobody listens there any more
                del self._handoffs[running]
            for request_id in lost or ():
                self._listener_gone(request_id)

    def _deliver(self, events: list[StepEvent]) -> None:
        for event in events:
            callback = self._callbacks.get(event.request_id)
            if event.finished and self._callbacks.pop(event.request_id, None):
                self._count(-1)
            if callback and not _notify(callback, event):
                self._listener_gone(event.request_id)

    def _listener_gone(self, request_id: str) -> None:
        """Stop decoding for nobody."""
        if self._callbacks.pop(request_id, None):
            self._count(-1)
            self.engine.abort(request_id)


def _notify(callback: EventCallback, event: StepEvent) -> bool:
    """Hand an event to its listener; whether that worked (a listener's error stays its own)."""
    try:
        callback(event)
    except Exception:
        log.exception("delivering an event of request %s failed", event.request_id)
        return False
    return True


class _Handoff:
    """Step events bound for one asyncio loop's queues: gathered on the engine loop's thread during
    a turn, then handed over in one thread-safe call."""

    def __init__(self, running: asyncio.AbstractEventLoop):
        self.running = running
        self.pending: list[tuple[asyncio.Queue, StepEvent | BaseException]] = []

    def post(self, queue: asyncio.Queue, event: StepEvent | BaseException) -> None:
        self.pending.append((queue, event))

    def flush(self) -> set[str] | None:
        """Hand the gathered events over; if the loop is closed, the ids of their requests."""
        if not self.pending:
            return None
        batch, self.pending = self.pending, []
        try:
            self.running.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            return {event.request_id for _, event in batch if isinstance(event, StepEvent)}
        return None


def _put_all(batch: list[tuple[asyncio.Queue, StepEvent | BaseException]]) -> None:
    for events, event in batch:
        events.put_nowait(event)


def least_loaded(loops: Sequence[EngineLoop]) -> EngineLoop:
    """Where a router sends new work: the loop holding the fewest unfinished requests."""
    return min(loops, key=lambda loop: loop.load)


async def stream(loop: EngineLoop, request: GenerationRequest, timeout_s: float | None = None) -> AsyncIterator[StepEvent]:
    """The request's step events as an async iterator; leaving early (a cancelled client) aborts it,
    and so does `timeout_s` passing before its last event, which raises TimeoutError."""
    events: asyncio.Queue[StepEvent | BaseException] = asyncio.Queue()
    running = asyncio.get_running_loop()
    loop.submit(request, partial(loop.handoff(running).post, events))
    timer = None if timeout_s is None else running.call_later(timeout_s, events.put_nowait, TimeoutError())
    finished = False
    try:
        while not finished:
            event = await events.get()
            if isinstance(event, BaseException):
                raise event
            finished = event.finished is not None
            yield event
    finally:
        if timer is not None:
            timer.cancel()
        if not finished:
            loop.abort(request.request_id)
