"""Placement on a local Ray cluster with 4 fake GPUs: disjoint GPU sets, fast and clear failures."""
from __future__ import annotations

import time

import pytest
import ray
from pydantic import ValidationError

from cluster.engine.config import EngineConfig
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.placement import PlacementError, actor_options, check_group_fits_a_node, reserve
from tests.cluster.ray_fixtures import ray_four_gpus  # noqa: F401  (module-scoped fixture)

on_ray = pytest.mark.usefixtures("ray_four_gpus")


@ray.remote
class Probe:
    """Reports what Ray gave it: the GPU ids and the node."""

    def where(self) -> tuple[list, str]:
        return ray.get_gpu_ids(), ray.get_runtime_context().get_node_id()


def wait_for_gpus(expected: float, timeout_s: float = 10) -> None:
    """Removing a placement group frees its GPUs asynchronously; wait for them to come back."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0.0) < expected:
        assert time.monotonic() < deadline, f"GPUs not freed: {ray.available_resources()}"
        time.sleep(0.05)


@on_ray
def test_target_shards_and_drafts_get_disjoint_gpus():
    spec = ClusterSpec(tensor_parallel_size=2, num_draft_actors=2, engine=EngineConfig(method="draft"))
    placement = reserve(spec)
    try:
        assert placement.notes == []
        assert ray.util.placement_group_table(placement.target_groups[0])["strategy"] == "STRICT_PACK"
        assert ray.util.placement_group_table(placement.drafts)["strategy"] == "SPREAD"
        shards = [Probe.options(**placement.target_options(0, rank)).remote() for rank in range(2)]
        drafts = [Probe.options(**placement.draft_options(i)).remote() for i in range(2)]
        shard_gpus, shard_nodes = zip(*ray.get([actor.where.remote() for actor in shards]))
        draft_gpus, _ = zip(*ray.get([actor.where.remote() for actor in drafts]))
        assert all(len(ids) == 1 for ids in shard_gpus + draft_gpus)
        assert len({ids[0] for ids in shard_gpus + draft_gpus}) == 4
        assert len(set(shard_nodes)) == 1
    finally:
        placement.release()
        placement.release()  # idempotent
    wait_for_gpus(4)


@on_ray
def test_spec_larger_than_cluster_fails_fast_with_the_numbers():
    spec = ClusterSpec(tensor_parallel_size=2, num_target_groups=2, num_draft_actors=2)
    start = time.monotonic()
    with pytest.raises(PlacementError) as error:
        reserve(spec)
    assert time.monotonic() - start < 3
    assert str(error.value) == (
        "cluster spec needs 6 GPUs (2 target groups x TP 2 x 1 + 2 draft actors x 1) but the Ray cluster has 4"
    )


@on_ray
def test_groups_that_cannot_be_reserved_time_out_and_are_removed():
    holder = reserve(ClusterSpec(tensor_parallel_size=2, num_draft_actors=2))
    try:
        spec = ClusterSpec(engine=EngineConfig(method="none"), placement_timeout_s=0.5)
        expected = r"not ready after 0.5 s: target group 0\. .*needs 1 GPU, 0 CPU; .*had 0 GPU"
        with pytest.raises(PlacementError, match=expected):
            reserve(spec)
    finally:
        holder.release()
    wait_for_gpus(4)
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


@on_ray
def test_plain_decoding_places_no_draft_actors():
    spec = ClusterSpec(engine=EngineConfig(method="none"), num_draft_actors=3)
    assert spec.draft_bundles() == [] and spec.total_gpus() == 1
    placement = reserve(spec)
    try:
        assert placement.drafts is None
        with pytest.raises(PlacementError, match="no draft actors"):
            placement.draft_strategy(0)
    finally:
        placement.release()
    wait_for_gpus(4)


def test_drafter_without_draft_actors_is_rejected_naming_the_field():
    with pytest.raises(ValidationError, match="num_draft_actors must be >= 1 when engine.method is 'draft'"):
        ClusterSpec(engine=EngineConfig(method="draft"), num_draft_actors=0)
    with pytest.raises(ValidationError, match="extra"):
        ClusterSpec(num_gpus=4)


def test_bundles_and_actor_options():
    spec = ClusterSpec(tensor_parallel_size=2, gpus_per_target_shard=1, gpus_per_draft_actor=0, cpus_per_actor=0)
    assert spec.target_bundles() == [{"GPU": 1}, {"GPU": 1}]
    assert spec.draft_bundles() == [{"CPU": 0.01}]  # Ray refuses a bundle asking for nothing
    assert actor_options({"GPU": 1}) == {"num_gpus": 1, "num_cpus": 0.0}
    assert actor_options({"CPU": 0.01}) == {"num_gpus": 0.0, "num_cpus": 0.01}


def test_a_target_group_no_node_can_hold_is_refused():
    nodes = [
        {"Alive": True, "Resources": {"GPU": 2.0, "CPU": 8.0}},
        {"Alive": False, "Resources": {"GPU": 8.0, "CPU": 8.0}},
    ]
    check_group_fits_a_node([{"GPU": 1}] * 2, nodes)
    with pytest.raises(PlacementError, match="must share a node"):
        check_group_fits_a_node([{"GPU": 1}] * 4, nodes)
