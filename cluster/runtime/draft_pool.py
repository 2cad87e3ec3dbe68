"""A pool of draft actors shared by the target groups of every replica of a model.

A drafter costs a few percent of a target, so draft GPUs that grow in lockstep with target groups
are mostly idle. With `ClusterSpec.draft_pool`, the draft actors form one pool per pool name (M
drafters : N target groups, from any replica), held by a named, detached `DraftPool` actor that
outlives any one replica: replicas attach on start and detach on shutdown, a replica that stops
reporting (each reports every `report_period_s`, busy or idle) is dropped, and the pool ends itself
(its drafters and their placement groups with it) once no replica has been attached for
`idle_shutdown_s`. Ray restarts a keeper whose process or node dies, with fresh drafters (the old
ones and their groups die with their owner); a replica that finds its pool gone for good creates it
again (the first of several to ask does; the others attach to it).

Each target group drafts through a `PooledDrafter`: a request's calls go to the drafter that holds
its state, a new request to the drafter this client loads least; a drafter that fails (its process,
its node) loses its requests to the others, which rebuild them from the tokens the next call carries
(the draft worker's protocol: a request it does not know comes back as `unknown` and is sent whole).
Finished outputs are sent to every drafter, so suffix decoding's index of earlier outputs stays
whole in every drafter, under the request's cache scope.

The pool sizes itself between `min_drafters` and `max_drafters` on its own signal: the time a draft
call waits (queue and transfer: its round trip less the drafter's own work) against the time of the
target's verification pass, both reported by the clients every `report_period_s`. A period in
which the clients reported and made no draft call counts as no wait, so an idle pool shrinks.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import ray
from ray.util.metrics import Gauge
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.draft_worker import DraftReply, DraftWorker
from cluster.runtime.draft_pool_spec import DraftPoolSpec
from cluster.runtime.placement import PlacementError, group_name
from speculators.proposers.base import DraftRequest
from speculators.tree import DraftTree

log = logging.getLogger(__name__)
NAMESPACE = "specserve"


@dataclass
class Window:
    """Waits and passes reported since the pool last decided its size."""

    reports: int = 0
    calls: int = 0
    wait_s: float = 0.0
    passes: int = 0
    pass_s: float = 0.0

    def add(self, calls: int, wait_s: float, passes: int, pass_s: float) -> None:
        self.reports += 1
        self.calls, self.wait_s = self.calls + calls, self.wait_s + wait_s
        self.passes, self.pass_s = self.passes + passes, self.pass_s + pass_s

    def wait_fraction(self) -> float | None:
        """Mean wait of a draft call over mean target pass: 0 when clients reported no call (idle);
        None when nobody reported, or calls came without target passes to compare them with."""
        if not self.reports:
            return None
        if not self.calls:
            return 0.0
        if not self.passes or self.pass_s <= 0:
            return None
        return (self.wait_s / self.calls) / (self.pass_s / self.passes)


def decide_size(size: int, fraction: float | None, spec: DraftPoolSpec, low_since: float | None,
                now: float) -> tuple[int, float | None]:
    """The pool's next size and since when waits have been low: one drafter more when calls wait
    too long, one fewer when they have waited little for scale_down_after_s."""
    if fraction is None:
        return size, low_since
    if fraction > spec.scale_up_wait_fraction and size < spec.max_drafters:
        return size + 1, None
    if fraction >= spec.scale_down_wait_fraction:
        return size, None
    low_since = now if low_since is None else low_since
    if now - low_since >= spec.scale_down_after_s and size > spec.min_drafters:
        return size - 1, None
    return size, low_since


@dataclass
class Member:
    member_id: str
    actor: object
    group: object


class DraftPool:
    """The pool's keeper (a named, detached Ray actor; see the module docstring)."""

    def __init__(self, spec, fingerprint: str):
        """`spec` is the ClusterSpec of the replica that created the pool (its engine, drafter,
        labels and draft resources); `fingerprint` what every attaching replica must match."""
        from cluster.runtime.spec_cluster import draft_actor_builder  # the replica side's module, not imported by it

        self.spec, self.pool, self.fingerprint = spec, spec.draft_pool, fingerprint
        self._builder = draft_actor_builder(spec, self.pool.groups_per_drafter)
        self.members: list[Member] = []
        self._incarnation, self._changes = uuid.uuid4().hex[:8], 0
        """The members' version: a restarted keeper (new drafters) never repeats an earlier one."""
        self.clients: dict[str, float] = {}  # client id -> last heard from
        self.window, self._low_since = Window(), None
        self._decided = time.monotonic()
        self._lock = threading.Lock()
        tags = {"pool": self.pool.name}
        self._drafters_gauge = Gauge("specserve_draft_pool_drafters", "drafters in the draft pool", tag_keys=("pool",))
        self._wait_gauge = Gauge("specserve_draft_pool_wait_fraction", "mean wait of a draft call (queue, transfer) "
                                 "over the mean target pass, over the pool's last decision period", tag_keys=("pool",))
        self._resize(self.pool.min_drafters)
        self._idle_since: float | None = time.monotonic()
        self._drafters_gauge.set(len(self.members), tags)
        threading.Thread(target=self._watch, daemon=True, name="draft-pool-watch").start()

    @property
    def version(self) -> str:
        return f"{self._incarnation}.{self._changes}"

    def _resize(self, size: int) -> None:
        """Add or remove drafters until there are `size` (outside the lock: placing one may take
        placement_timeout_s, and clients keep reporting meanwhile)."""
        while len(self.members) < size:
            member = self._place()
            with self._lock:
                self.members, self._changes = [*self.members, member], self._changes + 1
            log.info("draft pool %s: %d drafters", self.pool.name, len(self.members))
        while len(self.members) > size:
            with self._lock:
                member, self.members, self._changes = self.members[-1], self.members[:-1], self._changes + 1
            ray.kill(member.actor)
            remove_placement_group(member.group)
            log.info("draft pool %s: %d drafters", self.pool.name, len(self.members))

    def _place(self) -> Member:
        """One drafter, in a placement group of its own (on a draft-labelled node when the spec
        names labels); PlacementError when it cannot be placed within placement_timeout_s."""
        draft = self.spec.draft_bundle()
        group = placement_group([draft], bundle_label_selector=[dict(self.spec.draft_node_labels)]
                                if self.spec.draft_node_labels else None, name=group_name(f"draft pool {self.pool.name}"))
        ready, _ = ray.wait([group.ready()], timeout=self.spec.placement_timeout_s)
        if not ready:
            remove_placement_group(group)
            raise PlacementError(f"draft pool {self.pool.name!r}: a drafter ({_describe(draft)}"
                                 f"{' on nodes labelled ' + str(self.spec.draft_node_labels) if self.spec.draft_node_labels else ''})"
                                 f" could not be placed within {self.spec.placement_timeout_s:g} s")
        actor = ray.remote(DraftWorker).options(
            max_restarts=-1, num_gpus=draft.get("GPU", 0.0), num_cpus=draft.get("CPU", 0.0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0),
        ).remote(self._builder, learn_in_background=True)
        return Member(uuid.uuid4().hex[:8], actor, group)

    def attach(self, client_id: str, fingerprint: str) -> tuple[str, list[tuple[str, object]]]:
        """Register a client (one target group); the pool's members. A client whose deployment
        differs from the pool's (another model or drafter) is refused with what differs."""
        if fingerprint != self.fingerprint:
            raise ValueError(f"draft pool {self.pool.name!r} serves {self.fingerprint}; this replica asks for "
                             f"{fingerprint}: give it a draft_pool.name of its own")
        with self._lock:
            self.clients[client_id] = time.monotonic()
            self._idle_since = None
            return self.members_now()

    def detach(self, client_id: str) -> None:
        with self._lock:
            self.clients.pop(client_id, None)
            if not self.clients:
                self._idle_since = time.monotonic()

    def members_now(self) -> tuple[str, list[tuple[str, object]]]:
        return self.version, [(m.member_id, m.actor) for m in self.members]

    def report(self, client_id: str, calls: int, wait_s: float, passes: int, pass_s: float) -> str:
        """A client's waits and target passes since its last report; the members' version, so that a
        client learns of a resize (or of a restarted keeper) with its next report."""
        with self._lock:
            self.clients[client_id] = time.monotonic()
            self._idle_since = None
            self.window.add(calls, wait_s, passes, pass_s)
            return self.version

    def size(self) -> int:
        return len(self.members)

    def _watch(self) -> None:
        """Resize on the reported waits; drop silent clients; end the pool when none is left."""
        period = self.pool.report_period_s
        while True:
            time.sleep(period)
            size = None
            with self._lock:
                now = time.monotonic()
                for client, heard in list(self.clients.items()):
                    if now - heard > max(10 * period, 30.0):
                        log.warning("draft pool %s: client %s stopped reporting; dropped", self.pool.name, client)
                        del self.clients[client]
                        if not self.clients:
                            self._idle_since = now
                if self._idle_since is not None and now - self._idle_since >= self.pool.idle_shutdown_s:
                    break
                if now - self._decided >= 5 * period:
                    fraction = self.window.wait_fraction()
                    if fraction is not None:
                        self._wait_gauge.set(fraction, {"pool": self.pool.name})
                    size, self._low_since = decide_size(len(self.members), fraction, self.pool, self._low_since, now)
                    self.window, self._decided = Window(), now
            if size is not None:
                try:
                    self._resize(size)
                except PlacementError as error:  # no room now; the next decision tries again
                    log.warning("%s", error)
                self._drafters_gauge.set(len(self.members), {"pool": self.pool.name})
        log.info("draft pool %s: no replica for %g s; ending", self.pool.name, self.pool.idle_shutdown_s)
        self._resize(0)
        ray.kill(ray.get_runtime_context().current_actor)  # detached: nobody else ends it


def _describe(bundle: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in bundle.items())


def pool_actor(spec, fingerprint: str):
    """The pool named in `spec.draft_pool`: the running one, or a new one (the first replica to ask
    creates it; Ray makes the others get that one)."""
    name = f"draft-pool-{spec.draft_pool.name}"
    return ray.remote(DraftPool).options(
        name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0, max_concurrency=16,
        max_restarts=-1,
    ).remote(spec, fingerprint)


@dataclass
class _Call:
    """One draft call of the engine, split over the drafters that hold its requests."""

    requests: list[DraftRequest]
    parts: dict[str, list[int]] = field(default_factory=dict)  # member id -> indices into requests
    replies: dict[str, DraftReply | BaseException] = field(default_factory=dict)
    submitted: float = field(default_factory=time.perf_counter)


class PooledDrafter:
    """A target group's drafter: the pool's members behind the engine's worker convention.

    A thread of its own reports to the pool every report_period_s (busy or idle: an attached replica
    keeps its pool alive), fetches the members when their version changed or a member failed, and
    attaches again, creating the pool anew, when the pool is gone for good."""

    def __init__(self, connect: Callable[[], object], fingerprint: str, report_period_s: float, counters=None):
        """`connect()` returns the pool's actor handle (creating the pool if there is none)."""
        self.connect, self.fingerprint, self.client_id = connect, fingerprint, uuid.uuid4().hex[:12]
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
        self._attach()
        threading.Thread(target=self._report_forever, daemon=True, name="draft-pool-client").start()

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
        call, future = _Call(list(requests)), Future()
        if not self.members:  # the pool has no drafter now: a plain step
            future.set_exception(RuntimeError("the draft pool has no drafter"))
            self._stale.set()
            return future
        with self._lock:
            for index, request in enumerate(call.requests):
                call.parts.setdefault(self._choose(request.request_id), []).append(index)
            actors = {member: self.members[member] for member in call.parts}
        for member, indices in call.parts.items():
            part = [call.requests[i] for i in indices]
            ray_future = actors[member].propose.remote(part).future()
            ray_future.add_done_callback(functools.partial(self._part_done, call, member, future))
        return future

    def _part_done(self, call: _Call, member: str, future: Future, done: Future) -> None:
        try:
            call.replies[member] = done.result()
        except BaseException as error:  # the member died or failed: its requests move on the next call
            call.replies[member] = error
        if len(call.replies) == len(call.parts):
            future.set_result(self._merge(call))

    def _merge(self, call: _Call) -> DraftReply:
        """One reply in the call's order; a failed member's requests get root-only trees and are
        reported unknown (sent whole next time, to another member)."""
        trees: list[DraftTree | None] = [None] * len(call.requests)
        unknown, elapsed, failed = [], time.perf_counter() - call.submitted, []
        for member, indices in call.parts.items():
            reply = call.replies[member]
            if isinstance(reply, BaseException):
                failed.append(member)
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
        if failed:
            log.warning("draft pool member(s) %s failed; their requests move to the others", failed)
            with self._lock:
                self.holder = {r: m for r, m in self.holder.items() if m not in failed}
                self._load = {m: sum(1 for held in self.holder.values() if held == m) for m in self.members}
                self._suspect.update(failed)
                pings = [(m, self.members[m].ping.remote().future()) for m in failed if m in self.members]
            for member, ping in pings:
                ping.add_done_callback(functools.partial(self._answered, member))
        return DraftReply(trees, unknown)

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
        try:
            ray.get(self.pool.detach.remote(self.client_id), timeout=10)
        except Exception as error:
            log.warning("could not detach from the draft pool: %s", error)


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
