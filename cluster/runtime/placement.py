"""Placement: which GPUs the target groups and the draft actors get.

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

Bundles list only the resources they need (a zero entry is dropped). Ray refuses a bundle that asks
for nothing, so a bundle of an actor that needs neither GPU nor CPU asks for `MIN_BUNDLE_CPU` CPU.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.engine.config import EngineConfig
from cluster.runtime.draft_pool_spec import DraftPoolSpec

log = logging.getLogger(__name__)

Bundle = dict[str, float]
MIN_BUNDLE_CPU = 0.01
CHECKED_RESOURCES = ("GPU", "CPU")
PENDING_LOG_AFTER_S = 3.0
"""A placement still pending after this long is logged with what each role's nodes hold."""
GROUP_PREFIX = "specserve: "


class PlacementError(RuntimeError):
    """The cluster cannot hold what the spec asks for."""


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="the target, the drafter and the scheduler every target group runs"
    )
    tensor_parallel_size: int = Field(1, ge=1, description="target shards (ranks) in one target group")
    num_target_groups: int = Field(
        1, ge=1, description="independent copies of the target, each a tensor-parallel group"
    )
    num_draft_actors: int = Field(
        1, ge=0, description="draft actors; must be >= 1 unless engine.method is none, where it is ignored"
    )
    gpus_per_draft_actor: float = Field(
        1, ge=0, description="GPUs of one draft actor; a fraction lets Ray put several actors on one GPU"
    )
    gpus_per_target_shard: float = Field(
        1, ge=0, description="GPUs of one target shard; a fraction lets Ray put several actors on one GPU"
    )
    cpus_per_actor: float = Field(
        0, ge=0, description="CPUs reserved per actor; 0 because GPU actors asking for CPUs exhaust a small node's CPUs"
    )
    placement_timeout_s: float = Field(30, gt=0, description="seconds to wait for the placement groups to be ready "
                                       "(on an autoscaling cluster, long enough to start a GPU node)")
    autoscaling_cluster: bool = Field(
        False, description="the Ray cluster adds nodes on demand (Ray autoscaler, KubeRay enableInTreeAutoscaling): a "
        "spec the alive nodes cannot hold waits up to placement_timeout_s for new ones, saying in the logs what it "
        "waits for, instead of failing at once")
    target_node_labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node labels a node must carry to hold target shards (KubeRay: the "
        "target worker group's `labels`), matched exactly; empty: any node")
    draft_node_labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node labels a node must carry to hold draft actors, matched exactly; "
        "empty: any node")
    colocate_drafter: bool = Field(
        False, description="run the drafter inside each target shard's process instead of draft actors (one-GPU "
        "deployments: a trained head then shares the target's embedding and LM head, and its hidden states stay in "
        "the process); needs tensor_parallel_size 1; num_draft_actors is then ignored")

    @model_validator(mode="after")
    def _drafter_has_actors(self) -> ClusterSpec:
        """A drafter with no actor to run it would leave every request without proposals."""
        if self.engine.method != "none" and self.num_draft_actors < 1:
            raise ValueError(
                f"num_draft_actors must be >= 1 when engine.method is {self.engine.method!r} "
                "(use engine.method='none' for plain decoding without draft actors)"
            )
        return self

    draft_pool: DraftPoolSpec | None = Field(
        None, description="draft from a pool shared by every replica naming it (its own drafters, sized on its "
        "own signal) instead of draft actors of this replica's own; num_draft_actors is then ignored")

    @model_validator(mode="after")
    def _pool_needs_a_drafter(self) -> ClusterSpec:
        if self.draft_pool is not None and (self.engine.method == "none" or self.colocate_drafter):
            raise ValueError("draft_pool needs a drafter in actors: engine.method other than 'none' and "
                             "colocate_drafter false")
        return self

    @model_validator(mode="after")
    def _labels_are_exact_values(self) -> ClusterSpec:
        """Ray reads `!v` and `in(a,b)` as operators; here a label is matched exactly, so refuse them
        rather than place by a rule the capacity check does not follow."""
        for name in ("target_node_labels", "draft_node_labels"):
            for key, value in getattr(self, name).items():
                if not value or value.startswith("!") or "(" in value or "," in value:
                    raise ValueError(f"{name}[{key!r}] must be one exact label value, got {value!r}")
        return self

    @model_validator(mode="after")
    def _colocated_needs_one_rank(self) -> ClusterSpec:
        if self.colocate_drafter and self.tensor_parallel_size != 1:
            raise ValueError("colocate_drafter needs tensor_parallel_size 1: with more ranks, put the drafter on its "
                             "own GPU (draft actors), where it reads the hidden states rank 0 sends")
        return self

    @property
    def draft_actor_count(self) -> int:
        """Draft actors this replica places: none for plain decoding, a co-located drafter or a draft
        pool (which places its own), whatever num_draft_actors says."""
        if self.engine.method == "none" or self.colocate_drafter or self.draft_pool is not None:
            return 0
        return self.num_draft_actors

    def draft_bundle(self) -> Bundle:
        """The bundle of one draft actor (or one drafter of a draft pool)."""
        return _bundle(self.gpus_per_draft_actor, self.cpus_per_actor)

    def target_bundles(self) -> list[Bundle]:
        """Bundles of one target group, one per tensor-parallel rank (rank i runs in bundle i)."""
        return [_bundle(self.gpus_per_target_shard, self.cpus_per_actor) for _ in range(self.tensor_parallel_size)]

    def draft_bundles(self) -> list[Bundle]:
        """Bundles of all draft actors (actor i runs in bundle i); empty when engine.method is none."""
        return [self.draft_bundle() for _ in range(self.draft_actor_count)]

    def total(self, resource: str) -> float:
        """How much of a resource all target groups and draft actors reserve together."""
        return sum(role.total(resource) for role in self.roles())

    def target_role(self) -> Role:
        """All target groups' bundles and the labels of the nodes that may hold them."""
        return Role("target groups", self.target_bundles() * self.num_target_groups, self.target_node_labels,
                    f"{self.num_target_groups} target groups x TP {self.tensor_parallel_size}")

    def draft_role(self) -> Role | None:
        """The draft actors' bundles and the labels of their nodes; None when no draft actor is placed."""
        if not self.draft_actor_count:
            return None
        return Role("draft actors", self.draft_bundles(), self.draft_node_labels, f"{self.draft_actor_count} draft actors")

    def roles(self) -> list[Role]:
        return [role for role in (self.target_role(), self.draft_role()) if role is not None]

    def total_gpus(self) -> float:
        """GPUs the whole spec reserves."""
        return self.total("GPU")

    def describe_total(self, resource: str) -> str:
        """The arithmetic behind `total`, so an error message shows where the number comes from."""
        target_each = self.target_bundles()[0].get(resource, 0.0)
        draft_each = self.draft_bundle().get(resource, 0.0)
        return (
            f"{self.num_target_groups} target groups x TP {self.tensor_parallel_size} x {target_each:g} + "
            f"{self.draft_actor_count} draft actors x {draft_each:g}"
        )


@dataclass(frozen=True)
class Role:
    """The bundles of one role and the labels of the nodes that may hold them."""

    role: str
    bundles: list[Bundle]
    labels: dict[str, str]
    arithmetic: str

    def total(self, resource: str) -> float:
        return sum(bundle.get(resource, 0.0) for bundle in self.bundles)

    def admits(self, node: dict) -> bool:
        """Whether an alive node (an entry of `ray.nodes()`) carries every label this role needs."""
        labels = node.get("Labels") or {}
        return bool(node.get("Alive")) and all(labels.get(key) == value for key, value in self.labels.items())

    def where(self) -> str:
        return "nodes labelled " + ", ".join(f"{k}={v}" for k, v in self.labels.items()) if self.labels else "the Ray cluster"

    def selector(self, bundles: int) -> list[dict[str, str]] | None:
        """bundle_label_selector of a placement group of `bundles` bundles of this role, or None."""
        return [dict(self.labels) for _ in range(bundles)] if self.labels else None


def _bundle(gpus: float, cpus: float) -> Bundle:
    """One actor's bundle: its non-zero resources, or a token CPU share because Ray refuses empty bundles."""
    bundle = {name: amount for name, amount in (("GPU", gpus), ("CPU", cpus)) if amount > 0}
    return bundle or {"CPU": MIN_BUNDLE_CPU}


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
                       for i in range(spec.num_target_groups)],
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
    check_group_fits_a_node(spec.target_bundles(), [node for node in nodes if targets.admits(node)], targets.where())


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
