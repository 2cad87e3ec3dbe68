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

Each target group drafts through a `PooledDrafter` (cluster/runtime/pooled_drafter.py), which
routes its requests to the pool's members and reports its waits to the keeper. The keeper sizes the
pool between `min_drafters` and `max_drafters` on those waits (cluster/runtime/pool_sizing.py), and
replaces a drafter that stops answering its health checks (cluster/runtime/member_checks.py), with a
warning naming it and `specserve_draft_pool_replaced_drafters` counting it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import ray
from ray.util.metrics import Counter, Gauge
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.draft_worker import DraftWorker
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.draft_actors import draft_actor_builder
from cluster.runtime.member_checks import MemberChecks
from cluster.runtime.placement import PlacementError, group_name
from cluster.runtime.pool_sizing import Window, decide_size

log = logging.getLogger(__name__)
NAMESPACE = "specserve"


@dataclass
class Member:
    member_id: str
    actor: object
    group: object


class DraftPool:
    """The pool's keeper (a named, detached Ray actor; see the module docstring)."""

    def __init__(self, spec: ClusterSpec, fingerprint: str):
        """`spec` is the ClusterSpec of the replica that created the pool (its engine, drafter,
        labels and draft resources); `fingerprint` what every attaching replica must match."""
        self.spec, self.pool, self.fingerprint = spec, spec.draft_pool, fingerprint
        self._builder = draft_actor_builder(spec, self.pool.groups_per_drafter)
        self.members: list[Member] = []
        self._incarnation, self._changes = uuid.uuid4().hex[:8], 0
        """The members' version: a restarted keeper (new drafters) never repeats an earlier one."""
        self.clients: dict[str, float] = {}  # client id -> last heard from
        self._ending = False
        """Set when the pool ends: a drafter placed after that is let go at once."""
        self.window, self._low_since = Window(), None
        self._decided = time.monotonic()
        self._lock = threading.Lock()
        tags = {"pool": self.pool.name}
        self._drafters_gauge = Gauge("specserve_draft_pool_drafters", "drafters in the draft pool", tag_keys=("pool",))
        self._wait_gauge = Gauge("specserve_draft_pool_wait_fraction", "mean wait of a draft call (queue, transfer) "
                                 "over the mean target pass, over the pool's last decision period", tag_keys=("pool",))
        self._replaced = Counter("specserve_draft_pool_replaced_drafters", "drafters the pool replaced because they "
                                 "stopped answering its health checks", tag_keys=("pool", "drafter"))
        self._checks = MemberChecks(self.pool.member_timeout_s, self.pool.member_misses)
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
                ending = self._ending
                if not ending:
                    self.members, self._changes = [*self.members, member], self._changes + 1
            if ending:
                _let_go(member)
                return
            log.info("draft pool %s: %d drafters", self.pool.name, len(self.members))
        while len(self.members) > size:
            self._remove(self.members[-1])
            log.info("draft pool %s: %d drafters", self.pool.name, len(self.members))

    def _remove(self, member: Member) -> None:
        """Take a member out and let it go; a member already taken out (by the other thread) is left be."""
        with self._lock:
            present = any(m is member for m in self.members)
            if present:
                self.members, self._changes = [m for m in self.members if m is not member], self._changes + 1
        if present:
            _let_go(member)

    def _replace_hung(self) -> None:
        """A drafter that missed member_misses health checks in a row goes, and a new one takes its place
        (clients learn of it with their next report; its requests move to the others meanwhile)."""
        for member in self._checks.check(list(self.members)):
            log.warning("draft pool %s: drafter %s missed %d health checks in a row (%g s each); replacing it",
                        self.pool.name, member.member_id, self.pool.member_misses, self.pool.member_timeout_s)
            self._replaced.inc(tags={"pool": self.pool.name, "drafter": member.member_id})
            size = len(self.members)
            self._remove(member)
            try:
                self._resize(size)
            except PlacementError as error:  # no room now: the next sizing decision tries again
                log.warning("%s", error)

    def _place(self) -> Member:
        """One drafter, in a placement group of its own (on a draft-labelled node when the spec
        names labels); PlacementError when it cannot be placed within placement_timeout_s."""
        draft = self.spec.draft_bundle()
        group = placement_group([draft], bundle_label_selector=[dict(self.spec.draft_node_labels)]
                                if self.spec.draft_node_labels else None, name=group_name(f"draft pool {self.pool.name}"))
        ready, _ = ray.wait([group.ready()], timeout=self.spec.placement_timeout_s)
        if not ready:
            remove_placement_group(group)
            labels = self.spec.draft_node_labels
            raise PlacementError(f"draft pool {self.pool.name!r}: a drafter ({_describe(draft)}"
                                 f"{' on nodes labelled ' + str(labels) if labels else ''})"
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
        """Resize on the reported waits; drop silent clients; end the pool when none is left.
        Replacing and resizing run on a thread of their own, one change at a time: placing a drafter
        may take placement_timeout_s, and meanwhile this loop still hears clients leave and ends
        the pool on time (a change in flight then dies with the keeper)."""
        period, change = self.pool.report_period_s, None
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
            if change is None or not change.is_alive():  # a decision made while one is in flight waits for the next
                change = threading.Thread(target=self._change, args=(size,), daemon=True, name="draft-pool-change")
                change.start()
            self._drafters_gauge.set(len(self.members), {"pool": self.pool.name})
        log.info("draft pool %s: no replica for %g s; ending", self.pool.name, self.pool.idle_shutdown_s)
        with self._lock:
            self._ending = True
        self._resize(0)
        ray.kill(ray.get_runtime_context().current_actor)  # detached: nobody else ends it

    def _change(self, size: int | None) -> None:
        """Replace hung drafters, then resize to `size` (None: keep the size)."""
        self._replace_hung()
        if size is not None:
            try:
                self._resize(max(size, self.pool.min_drafters))  # min_drafters: after a replacement found no room
            except PlacementError as error:  # no room now; the next decision tries again
                log.warning("%s", error)


def _let_go(member: Member) -> None:
    ray.kill(member.actor)
    remove_placement_group(member.group)


def _describe(bundle: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in bundle.items())


def pool_fingerprint(spec: ClusterSpec) -> str:
    """What replicas sharing a draft pool must agree on: the engine (target, drafter and their
    settings) and the drafters' resources and labels."""
    engine = spec.engine
    digest = hashlib.sha1(json.dumps([engine.model_dump(mode="json"), spec.gpus_per_draft_actor, spec.cpus_per_actor,
                                      spec.draft_node_labels, spec.draft_pool.model_dump()], sort_keys=True).encode())
    return f"model {engine.model}, method {engine.method} (settings {digest.hexdigest()[:10]})"


def pool_actor(spec: ClusterSpec, fingerprint: str):
    """The pool named in `spec.draft_pool`: the running one, or a new one (the first replica to ask
    creates it; Ray makes the others get that one)."""
    name = f"draft-pool-{spec.draft_pool.name}"
    return ray.remote(DraftPool).options(
        name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0, max_concurrency=16,
        max_restarts=-1,
    ).remote(spec, fingerprint)
