"""ClusterSpec: what one replica runs (its engine, its target groups, its drafters) and where (node
labels, GPU and CPU shares), validated when the application's args are read. Configuration only, without
Ray: cluster/runtime/placement.py reserves what a spec asks for.

Bundles list only the resources they need (a zero entry is dropped). Ray refuses a bundle that asks
for nothing, so a bundle of an actor that needs neither GPU nor CPU asks for `MIN_BUNDLE_CPU` CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.engine.config import EngineConfig
from cluster.runtime.draft_pool_spec import DraftPoolSpec

Bundle = dict[str, float]
MIN_BUNDLE_CPU = 0.01


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

    target_placement: Literal["auto", "actor", "replica"] = Field(
        "auto", description="where the target runs: `actor`, each rank a Ray actor of its own (a step is one actor call "
        "to every rank); `replica`, in the Serve replica's own process, on its engine loop's thread (a step is a "
        "function call: the engine core beside its model, as vLLM runs it; CPU with no GPU reserved, "
        "tensor_parallel_size 1 and one target group only; a failed pass reloads it in the process); `auto`, "
        "replica where that is allowed, else actor")

    @model_validator(mode="after")
    def _replica_target_is_one_cpu_rank(self) -> ClusterSpec:
        if self.target_placement == "replica" and not self._replica_target_allowed():
            raise ValueError("target_placement 'replica' needs engine.device cpu, gpus_per_target_shard 0, "
                             "tensor_parallel_size 1 and num_target_groups 1 (a tensor-parallel or GPU target runs "
                             "in actors)")
        return self

    def _replica_target_allowed(self) -> bool:
        return (self.engine.device == "cpu" and self.gpus_per_target_shard == 0 and self.tensor_parallel_size == 1
                and self.num_target_groups == 1)

    @property
    def target_in_replica(self) -> bool:
        """Whether the target runs in the replica's process (target_placement, `auto` resolved)."""
        return self.target_placement == "replica" or (self.target_placement == "auto" and self._replica_target_allowed())

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
    def _pool_parts_end_before_the_call(self) -> ClusterSpec:
        """Past draft_timeout_s the engine gives up on the whole pooled call (and the pooled drafter with
        it); a drafter's part must end before that, so that only its own requests go without drafts."""
        pool, engine = self.draft_pool, self.engine
        if pool is not None and pool.member_timeout_s >= engine.draft_timeout_s:
            raise ValueError(f"draft_pool.member_timeout_s ({pool.member_timeout_s:g}) must be below "
                             f"engine.draft_timeout_s ({engine.draft_timeout_s:g})")
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

    @property
    def placed_target_groups(self) -> int:
        """Target groups placed as actors: none when the target runs in the replica."""
        return 0 if self.target_in_replica else self.num_target_groups

    def target_role(self) -> Role:
        """All target groups' bundles and the labels of the nodes that may hold them."""
        groups = self.placed_target_groups
        return Role(role="target groups", bundles=self.target_bundles() * groups, labels=self.target_node_labels,
                    arithmetic=f"{groups} target groups x TP {self.tensor_parallel_size}")

    def draft_role(self) -> Role | None:
        """The draft actors' bundles and the labels of their nodes; None when no draft actor is placed."""
        if not self.draft_actor_count:
            return None
        return Role(role="draft actors", bundles=self.draft_bundles(), labels=self.draft_node_labels,
                    arithmetic=f"{self.draft_actor_count} draft actors")

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
            f"{self.placed_target_groups} target groups x TP {self.tensor_parallel_size} x {target_each:g} + "
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
