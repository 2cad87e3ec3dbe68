"""A target in the replica's own process (`target_placement`): the engine calls it on its loop thread,
with no actor between them; outputs, drafting and a failed pass's rebuild as with a target actor."""
from __future__ import annotations

import threading

import pytest

from actors.model.threads import PASS_THREAD_NAME
from actors.worker import LocalWorker
from cluster.engine.config import EngineConfig
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.spec_cluster import SpecCluster
from tests.cluster.ray_fixtures import ray_four_gpus  # noqa: F401  (module-scoped fixture)
from tests.cluster.runtime.cluster_requests import UNPLANNED, expected, requests, run_while  # noqa: F401  (fixture)


def engine(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", method="pld", max_sequences=4, max_len=256, **UNPLANNED)


def cpu_spec(model_dir, **fields) -> ClusterSpec:
    """A spec as configs/serve.yaml writes it for a CPU: no GPU reserved for any actor."""
    return ClusterSpec(engine=engine(model_dir), **{"gpus_per_target_shard": 0, "gpus_per_draft_actor": 0, **fields})


def test_auto_puts_one_cpu_rank_in_the_replica_and_anything_else_in_actors(tiny_model_dir):
    one_rank = cpu_spec(tiny_model_dir)
    assert one_rank.target_in_replica and one_rank.placed_target_groups == 0
    assert one_rank.target_role().bundles == []
    for fields in ({"tensor_parallel_size": 2}, {"num_target_groups": 2}, {"target_placement": "actor"},
                   {"gpus_per_target_shard": 1}):
        spec = cpu_spec(tiny_model_dir, **fields)
        assert not spec.target_in_replica and spec.placed_target_groups == spec.num_target_groups


@pytest.mark.parametrize("fields", [{"tensor_parallel_size": 2}, {"num_target_groups": 2}, {"gpus_per_target_shard": 1}])
def test_a_replica_target_of_more_than_one_cpu_rank_is_refused(tiny_model_dir, fields):
    with pytest.raises(ValueError, match="target_placement 'replica' needs"):
        cpu_spec(tiny_model_dir, target_placement="replica", **fields)


@pytest.fixture(scope="module")
def cluster(ray_four_gpus, tiny_model_dir):
    cluster = SpecCluster(cpu_spec(tiny_model_dir, target_placement="replica")).start()
    yield cluster
    cluster.shutdown()


def test_the_target_runs_on_the_loop_thread_and_decodes_as_plain_decoding(cluster, expected):
    assert isinstance(cluster.target_groups[0], LocalWorker)
    assert not cluster.placement.target_groups  # nothing reserved for a target actor
    outputs = cluster.generate(requests(), timeout_s=120)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.stats.accepted for o in outputs) > 0  # the draft actor's drafts were verified here
    loop_thread = next(t for t in threading.enumerate() if t.name == "engine-0")
    with open(f"/proc/self/task/{loop_thread.native_id}/comm") as comm:
        assert comm.read().strip() == PASS_THREAD_NAME  # its run-queue waits are the ones CoreShare reads


def test_a_failed_pass_fails_its_requests_then_the_target_is_reloaded(cluster, expected):
    target = cluster.target_groups[0]
    shard = target.target

    def fail(*args, **kwargs):
        raise RuntimeError("injected pass failure")

    outputs = run_while(cluster, lambda: setattr(shard, "verify", fail), "f")
    failed = [o for o in outputs if o.finish_reason == "error"]
    assert failed and all("retry" in o.error for o in failed)
    assert cluster.target_groups[0] is not target  # reloaded in this process
    again = cluster.generate(requests("g"), timeout_s=120)
    assert [o.token_ids for o in again] == expected
