"""Placement: which GPUs the target groups and the draft actors of a ClusterSpec
(cluster/runtime/cluster_spec.py) get.

Every actor that owns a device runs inside a bundle of a Ray placement group, and a bundle reserves its
resources for that group alone, so draft actors and target shards never share a (whole) GPU. The
shards of one target group are packed onto one node when a node can hold them, because their
all-reduces are on the critical path of every verification step; draft actors are spread, because
they talk only to the router.

On a cluster of several node pools (KubeRay worker groups for target GPUs and for draft GPUs), the
spec's node labels send each bundle to its nodes: Ray's `bundle_label_selector` on the placement group,
matched against the labels a node was started with (`ray start --labels`, a worker group's `labels`).

Two things Ray does not do for us, and so this module does:
- A placement group that cannot be satisfied never becomes ready and never says why. `reserve` checks
  the spec against the alive nodes (their totals and labels) before creating anything and explains what
  is missing: at once on a fixed cluster; on an autoscaling one it logs the explanation, creates the
  groups anyway (a pending placement group is what Ray's autoscaler adds nodes for) and waits. Either
  way a timeout ends the wait, and the error says which groups were pending and what was free.
- An actor placed in a bundle must ask for no more than the bundle holds, and Ray's default actor
  (1 CPU to schedule) does not fit a GPU-only bundle. `actor_options` derives an actor's request from
  its bundle, so the two cannot drift apart.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.runtime.cluster_spec import Bundle, ClusterSpec, Role

log = logging.getLogger(__name__)

CHECKED_RESOURCES = ("GPU", "CPU")
PENDING_LOG_AFTER_S = 3.0
"""A placement still pending after this long is logged with what each role's nodes hold."""
GROUP_PREFIX = "specserve: "


class PlacementError(RuntimeError):
    """The cluster cannot hold what the spec asks for."""


def actor_options(bundle: Bundle) -> dict[str, float]:
    """`.options()` kwargs asking exactly what the bundle holds.

    Both keys are always given: an actor that leaves num_cpus unset asks for 1 CPU, which does not fit
    a GPU-only bundle.
    """
    return {"num_gpus": bundle.get("GPU", 0.0), "num_cpus": bundle.get("CPU", 0.0)}


@dataclass
class Placement:
    """The reserved placement groups, and how to start an actor inside them."""

    target_groups: list[PlacementGroup]
    drafts: PlacementGroup | None
    notes: list[str] = field(default_factory=list)

    def target_strategy(self, group_index: int, rank: int) -> PlacementGroupSchedulingStrategy:
        """Where target group `group_index`'s shard `rank` runs: that group's bundle `rank`."""
        return _strategy(self.target_groups[group_index], rank)

    def draft_strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        """Where draft actor `index` runs: bundle `index` of the draft group."""
        return _strategy(self._draft_group(), index)

    def target_options(self, group_index: int, rank: int) -> dict:
        """Complete `.options()` kwargs of a target shard: its bundle's resources and its strategy."""
        bundle = self.target_groups[group_index].bundle_specs[rank]
        return {**actor_options(bundle), "scheduling_strategy": self.target_strategy(group_index, rank)}

    def draft_options(self, index: int) -> dict:
        """Complete `.options()` kwargs of a draft actor: its bundle's resources and its strategy."""
        bundle = self._draft_group().bundle_specs[index]
        return {**actor_options(bundle), "scheduling_strategy": self.draft_strategy(index)}

    def release(self) -> None:
        """Remove every placement group (killing the actors in them); calling it again does nothing."""
        for group in self._groups():
            remove_placement_group(group)
        self.target_groups = []
        self.drafts = None

    def _groups(self) -> list[PlacementGroup]:
        """Every group still held, target groups first."""
        return self.target_groups + ([self.drafts] if self.drafts is not None else [])

    def _draft_group(self) -> PlacementGroup:
        """The draft group, or a clear error instead of Ray's confusing one about a None group."""
        if self.drafts is None:
            raise PlacementError("no draft actors were placed (engine.method='none' or released)")
        return self.drafts


def _strategy(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    """Ray only notices a bad bundle index when the actor is created; fail where the mistake is made."""
    if not 0 <= index < group.bundle_count:
        raise IndexError(f"bundle index {index} out of range for a placement group of {group.bundle_count} bundles")
    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


def reserve(spec: ClusterSpec) -> Placement:
    """Create the spec's placement groups and wait until Ray has reserved them all.

    Raises PlacementError at once if the alive nodes could never hold the spec (unless the cluster
    autoscales: then the reason is logged and the groups wait for new nodes), or after
    spec.placement_timeout_s if the groups could not be reserved (resources held by others, or
    fragmented across nodes); groups already created are removed first, so a failed call holds nothing.
    """
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    try:
        check_capacity(spec, nodes)
    except PlacementError as error:
        if not spec.autoscaling_cluster:
            raise
        log.warning("waiting up to %g s for the autoscaler to add nodes: %s", spec.placement_timeout_s, error)
    available = ray.available_resources()
    targets, drafts = spec.target_role(), spec.draft_role()
    model = spec.engine.model.rstrip("/").rsplit("/", 1)[-1]
    placement = Placement(
        target_groups=[placement_group(spec.target_bundles(), strategy="STRICT_PACK",
                                       bundle_label_selector=targets.selector(spec.tensor_parallel_size),
                                       name=group_name(f"{model} target group {i}"))
                       for i in range(spec.placed_target_groups)],
        drafts=placement_group(drafts.bundles, strategy="SPREAD", bundle_label_selector=drafts.selector(len(drafts.bundles)),
                               name=group_name(f"{model} draft actors"))
        if drafts else None,
        notes=_notes(spec),
    )
    _wait_ready(placement, spec, available)
    return placement


def group_name(what: str) -> str:
    """A placement group's name: this project's prefix, by which `pending_placements` finds it, and
    a suffix of its own (Ray refuses a second group of the same name: each replica has its groups)."""
    return f"{GROUP_PREFIX}{what} ({uuid.uuid4().hex[:6]})"


def pending_placements() -> list[dict]:
    """This project's placement groups that Ray has not reserved (cluster-wide, every replica's and
    pool's): name, bundles, and Ray's reason (NO_RESOURCES: no node has room now, which is what
    the autoscaler adds nodes for; INFEASIBLE: no node could ever hold a bundle). For /health."""
    pending = []
    for group in ray.util.placement_group_table().values():
        if group["name"].startswith(GROUP_PREFIX) and group["state"] in ("PENDING", "RESCHEDULING"):
            pending.append({"group": group["name"][len(GROUP_PREFIX):],
                            "bundles": [_format(bundle) for _, bundle in sorted(group["bundles"].items())],
                            "state": group["stats"]["scheduling_state"]})
    return pending


def check_capacity(spec: ClusterSpec, nodes: list[dict]) -> None:
    """Refuse a spec the alive nodes (entries of `ray.nodes()`) could never hold: Ray would leave its
    groups pending forever. Checks the whole spec against the whole cluster, each role against the
    nodes its labels admit, and that one such node holds a whole target group."""
    for resource, needed, present in _shortfalls(spec.total, nodes):
        raise PlacementError(f"cluster spec needs {needed:g} {resource}s ({spec.describe_total(resource)}) "
                             f"but the Ray cluster has {present:g}")
    for labels, roles in _by_labels(spec.roles()).items():
        admitted = [node for node in nodes if roles[0].admits(node)]
        for resource, needed, present in _shortfalls(lambda r: sum(role.total(r) for role in roles), admitted):
            raise PlacementError(f"{' and '.join(role.role for role in roles)} need {needed:g} {resource}s "
                                 f"({' + '.join(role.arithmetic for role in roles)}) on {roles[0].where()}, "
                                 f"which have {present:g} ({len(admitted)} alive)")
    targets = spec.target_role()
    if spec.placed_target_groups:
        check_group_fits_a_node(spec.target_bundles(), [node for node in nodes if targets.admits(node)],
                                targets.where())


def check_group_fits_a_node(bundles: list[Bundle], nodes: Iterable[dict], where: str = "the Ray cluster") -> None:
    """Refuse a target group no alive node can hold: its shards rendezvous on 127.0.0.1 and all-reduce
    on every step, so they are always packed on one node (STRICT_PACK), never scattered.

    `nodes` is what `ray.nodes()` returns (those the group's labels admit). Node totals are compared,
    not what is free now: a group that fits a busy node waits for it.
    """
    need = _sum(bundles)
    for node in nodes:
        resources = _resources(node)
        if node.get("Alive") and all(resources.get(name, 0.0) >= amount for name, amount in need.items()):
            return
    raise PlacementError(
        f"no alive node of {where} can hold a whole target group ({_format(need)}): the shards of a "
        "tensor-parallel group must share a node; lower tensor_parallel_size or add bigger nodes"
    )


def _by_labels(roles: list[Role]) -> dict[tuple, list[Role]]:
    """Roles that name node labels, grouped by them: roles sent to the same nodes must fit there together."""
    groups: dict[tuple, list[Role]] = {}
    for role in roles:
        if role.labels:
            groups.setdefault(tuple(sorted(role.labels.items())), []).append(role)
    return groups


def _resources(node: dict) -> dict[str, float]:
    return node.get("Resources") or {}


def _shortfalls(needs, nodes: list[dict]) -> list[tuple[str, float, float]]:
    """(resource, needed, present) for each checked resource the nodes hold less of than `needs(resource)`."""
    present = {resource: sum(_resources(node).get(resource, 0.0) for node in nodes) for resource in CHECKED_RESOURCES}
    return [(resource, needs(resource), present[resource]) for resource in CHECKED_RESOURCES
            if needs(resource) > present[resource]]


def _notes(spec: ClusterSpec) -> list[str]:
    """Compromises made for this spec, kept for logs: where the placement is weaker than promised."""
    notes = []
    if any(amount % 1 for amount in (spec.gpus_per_target_shard, spec.gpus_per_draft_actor)):
        notes.append("fractional GPUs per actor: Ray may give several actors (draft or target) the same GPU")
    return notes


def _wait_ready(placement: Placement, spec: ClusterSpec, available: dict[str, float]) -> None:
    """Wait for every group; say within seconds in the log which are pending, and on timeout release
    them all and say which were pending and what was free."""
    labelled = [(f"target group {i}", group) for i, group in enumerate(placement.target_groups)]
    if placement.drafts is not None:
        labelled.append(("draft group", placement.drafts))
    refs = {group.ready(): label for label, group in labelled}
    first = min(PENDING_LOG_AFTER_S, spec.placement_timeout_s)
    _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=first)
    if pending and spec.placement_timeout_s > first:
        log.warning("placement groups pending after %g s: %s; waiting up to %g s (%s)", first,
                    ", ".join(refs[r] for r in pending), spec.placement_timeout_s, _free_by_role(spec))
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=spec.placement_timeout_s - first)
    if not pending:
        return
    placement.release()
    needed = {resource: spec.total(resource) for resource in CHECKED_RESOURCES}
    free = {resource: available.get(resource, 0.0) for resource in CHECKED_RESOURCES}
    raise PlacementError(
        f"placement groups not ready after {spec.placement_timeout_s:g} s: {', '.join(refs[r] for r in pending)}. "
        f"The spec needs {_format(needed)}; when reserving, the cluster had {_format(free)} free. "
        "Other placement groups or actors hold the rest, or no node fits a packed target group."
    )


def _free_by_role(spec: ClusterSpec) -> str:
    """What each role's nodes have free now, for the log of a pending placement."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    free = ray.available_resources()  # cluster-wide; per node only where labels split the pools
    parts = []
    for role in spec.roles():
        admitted = [node for node in nodes if role.admits(node)]
        total = {r: sum(_resources(n).get(r, 0.0) for n in admitted) for r in CHECKED_RESOURCES}
        parts.append(f"{role.role} need {_format({r: role.total(r) for r in CHECKED_RESOURCES})} on "
                     f"{role.where()}: {len(admitted)} alive with {_format(total)} in all")
    return "; ".join(parts) + f"; free in the cluster: {_format({r: free.get(r, 0.0) for r in CHECKED_RESOURCES})}"


def _sum(bundles: list[Bundle]) -> Bundle:
    """Resources of several bundles together: what one node needs to hold them all."""
    total: Bundle = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def _format(resources: dict[str, float]) -> str:
    """'4 GPU, 0 CPU': resource amounts as a message shows them."""
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())
