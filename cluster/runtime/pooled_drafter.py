"""PooledDrafter: a target group's drafter when its replica drafts from a draft pool
(cluster/runtime/draft_pool.py, the pool's keeper).

A request's calls go to the drafter that holds its state, a new request to the drafter this client
loads least; a drafter that fails (its process, its node) loses its requests to the others, which
rebuild them from the tokens the next call carries (the draft worker's protocol: a request it does
not know comes back as `unknown` and is sent whole). Each drafter's part of a call has a deadline
(`member_timeout_s`): the call is answered with the parts that came back by then, and the requests
of a drafter that missed it (or failed) decode plainly that step and move to the others, so one
hung drafter does not stop drafting for the rest (the keeper replaces it after a few missed health
checks, draft_pool.py). Finished outputs are sent to every drafter, so
suffix decoding's index of earlier outputs stays whole in every drafter, under the request's cache
scope. Each client reports its draft calls' waits and its target's passes to the keeper, which sizes
the pool on them (cluster/runtime/pool_sizing.py).
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import ray

from actors.draft_worker import DraftReply
from speculators.proposers.base import DraftRequest
from speculators.tree import DraftTree

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """One draft call of the engine, split over the drafters that hold its requests."""

    requests: list[DraftRequest]
    future: Future = field(default_factory=Future)
    parts: dict[str, list[int]] = field(default_factory=dict)  # member id -> indices into requests
    replies: dict[str, DraftReply | BaseException] = field(default_factory=dict)
    submitted: float = field(default_factory=time.perf_counter)
    closed: bool = False
    """Answered (every part came back, or the deadline passed): a later reply is dropped."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class PooledDrafter:
    """A target group's drafter: the pool's members behind the engine's worker convention.

    A thread of its own reports to the pool every report_period_s (busy or idle: an attached replica
    keeps its pool alive), fetches the members when their version changed or a member failed, and
    attaches again, creating the pool anew, when the pool is gone for good. Another answers each
    draft call at its deadline with the parts that came back."""

    def __init__(self, connect: Callable[[], object], fingerprint: str, report_period_s: float,
                 member_timeout_s: float, counters=None):
        """`connect()` returns the pool's actor handle (creating the pool if there is none)."""
        self.connect, self.fingerprint, self.client_id = connect, fingerprint, uuid.uuid4().hex[:12]
        self.member_timeout_s = member_timeout_s
        self.counters = counters  # () -> EngineCounters of the engine drafting through this (set after it is built)
        self.holder: dict[str, str] = {}
        self.members: dict[str, object] = {}
        self.version: str | None = None
        self._load: dict[str, int] = {}
        self._suspect: set[str] = set()
        """Members whose last call failed: no new requests until they answer a ping (a restarted
        actor does; one that is gone for good leaves the pool's list)."""
        self._lock = threading.Lock()
        self.waited = [0, 0.0]
        """Draft calls and their seconds of waiting (round trip less the drafter's work), in all."""
        self._reported = (0, 0.0, 0, 0.0)  # calls, wait, target passes, pass seconds at the last report
        self._period = report_period_s
        self._stale, self._stop = threading.Event(), threading.Event()
        self._open: queue.Queue[_Call | None] = queue.Queue()
        """Calls in flight, in submission order (so their deadlines come in order too)."""
        self._attach()
        threading.Thread(target=self._report_forever, daemon=True, name="draft-pool-client").start()
        threading.Thread(target=self._close_at_deadlines, daemon=True, name="draft-pool-deadlines").start()

    def _attach(self) -> None:
        self.pool = self.connect()
        self._refresh(*ray.get(self.pool.attach.remote(self.client_id, self.fingerprint)))

    def _refresh(self, version: str, members: Sequence[tuple[str, object]]) -> None:
        with self._lock:
            self.version, self.members = version, dict(members)
            self.holder = {r: m for r, m in self.holder.items() if m in self.members}
            self._suspect &= set(self.members)
            self._load = {m: sum(1 for held in self.holder.values() if held == m) for m in self.members}

    def submit(self, method: str, *args) -> Future:
        if method == "propose":
            return self._propose(args[0])
        if method == "release":
            return self._release(*args)
        # runs_a_model, hidden_spec, flush, ping: any member answers for all
        return getattr(next(iter(self.members.values())), method).remote(*args).future()

    def _choose(self, request_id: str) -> str:
        """The member holding the request, else the one this client loads least."""
        member = self.holder.get(request_id)
        if member is None:
            healthy = [m for m in self.members if m not in self._suspect] or list(self.members)
            member = min(healthy, key=lambda m: self._load.get(m, 0))
            self.holder[request_id] = member
            self._load[member] = self._load.get(member, 0) + 1
        return member

    def _propose(self, requests: Sequence[DraftRequest]) -> Future:
        call = _Call(list(requests))
        if not self.members:  # the pool has no drafter now: a plain step
            call.future.set_exception(RuntimeError("the draft pool has no drafter"))
            self._stale.set()
            return call.future
        with self._lock:
            for index, request in enumerate(call.requests):
                call.parts.setdefault(self._choose(request.request_id), []).append(index)
            actors = {member: self.members[member] for member in call.parts}
        for member, indices in call.parts.items():
            part = [call.requests[i] for i in indices]
            ray_future = actors[member].propose.remote(part).future()
            ray_future.add_done_callback(functools.partial(self._part_done, call, member))
        self._open.put(call)
        return call.future

    def _part_done(self, call: _Call, member: str, done: Future) -> None:
        try:
            reply = done.result()
        except BaseException as error:  # the member died or failed: its requests move on the next call
            reply = error
        with call.lock:
            if call.closed:  # it came after the deadline: its requests were already given up
                return
            call.replies[member] = reply
            complete = len(call.replies) == len(call.parts)
        if complete:
            self._close(call)

    def _close_at_deadlines(self) -> None:
        """Answer each call by its deadline with the parts that came back (calls queue in the order sent)."""
        while (call := self._open.get()) is not None:
            wait([call.future], timeout=max(0.0, call.submitted + self.member_timeout_s - time.perf_counter()))
            self._close(call)

    def _close(self, call: _Call) -> None:
        """Answer the call once, by the last part to come back or by its deadline, whichever is first."""
        with call.lock:
            if call.closed:
                return
            call.closed = True
        call.future.set_result(self._merge(call))

    def _merge(self, call: _Call) -> DraftReply:
        """One reply in the call's order; the requests of a member that failed or missed the deadline get
        root-only trees and are reported unknown (sent whole next time, to another member)."""
        trees: list[DraftTree | None] = [None] * len(call.requests)
        unknown, elapsed = [], time.perf_counter() - call.submitted
        missed = [member for member in call.parts if member not in call.replies]
        failed = [member for member, reply in call.replies.items() if isinstance(reply, BaseException)]
        for member, indices in call.parts.items():
            reply = call.replies.get(member)
            if reply is None or isinstance(reply, BaseException):
                for i in indices:
                    trees[i] = DraftTree.root_only(call.requests[i].token_ids[-1])
                    unknown.append(call.requests[i].request_id)
                continue
            trees_of = iter(reply.trees)
            for i in indices:
                trees[i] = next(trees_of)
            unknown += reply.unknown
            with self._lock:
                self.waited[0] += 1
                self.waited[1] += max(0.0, elapsed - reply.busy_s)
        if missed:
            log.warning("draft pool member(s) %s missed the %g s deadline of a draft call; their requests decode "
                        "plainly this step and move to the others", missed, self.member_timeout_s)
        if failed:
            log.warning("draft pool member(s) %s failed; their requests move to the others", failed)
        if missed or failed:
            self._set_aside(missed + failed)
        return DraftReply(trees, unknown)

    def _set_aside(self, members: list[str]) -> None:
        """Members that failed or missed get no requests until they answer a ping; theirs move on."""
        with self._lock:
            self.holder = {r: m for r, m in self.holder.items() if m not in members}
            self._load = {m: sum(1 for held in self.holder.values() if held == m) for m in self.members}
            self._suspect.update(members)
            pings = [(m, self.members[m].ping.remote().future()) for m in members if m in self.members]
        for member, ping in pings:
            ping.add_done_callback(functools.partial(self._answered, member))

    def _answered(self, member: str, ping: Future) -> None:
        """A suspect member answered (restarted) or is gone (the pool's list is fetched again)."""
        try:
            ping.result()
        except Exception:
            self._stale.set()
        else:
            with self._lock:
                self._suspect.discard(member)

    def _release(self, request_ids: Sequence[str], outputs=(), scopes=()) -> Future:
        """Freed on their holders, learned by every member (each drafts for any request later)."""
        with self._lock:
            for request_id in request_ids:
                member = self.holder.pop(request_id, None)
                if member in self._load:
                    self._load[member] -= 1
            actors = list(self.members.values())
        futures = [actor.release.remote(request_ids, outputs, scopes).future() for actor in actors]
        return futures[0] if futures else _done(None)

    def _report_forever(self) -> None:
        while not self._stop.is_set():
            refetch = self._stale.wait(self._period)
            self._stale.clear()
            if self._stop.is_set():
                return
            try:
                version = ray.get(self.pool.report.remote(self.client_id, *self._since_last_report()),
                                  timeout=max(self._period, 10))
                if refetch or version != self.version:
                    self._refresh(*ray.get(self.pool.members_now.remote(), timeout=max(self._period, 10)))
            except ray.exceptions.ActorDiedError:
                log.warning("the draft pool is gone; creating it again")
                self._reconnect()
            except Exception as error:  # the pool is busy or restarting: keep the members known
                log.warning("draft pool did not answer: %s", error)

    def _since_last_report(self) -> tuple[int, float, int, float]:
        """Draft calls, their waits, target passes and their seconds since the last report."""
        counters = self.counters() if self.counters is not None else None
        passes, pass_s = (counters.steps, counters.verify_seconds) if counters is not None else (0, 0.0)
        with self._lock:
            totals = (*self.waited, passes, pass_s)
        since = tuple(now_total - then for now_total, then in zip(totals, self._reported))
        self._reported = totals
        return since

    def _reconnect(self) -> None:
        try:
            self._attach()
        except Exception as error:  # tried again on the next period
            log.warning("could not attach to the draft pool again: %s", error)

    def shutdown(self) -> None:
        self._stop.set()
        self._stale.set()
        self._open.put(None)
        try:
            ray.get(self.pool.detach.remote(self.client_id), timeout=10)
        except Exception as error:
            log.warning("could not detach from the draft pool: %s", error)


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
