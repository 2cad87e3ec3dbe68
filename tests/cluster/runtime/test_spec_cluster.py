"""The Ray cluster end to end on fake GPUs: TP=2 target group, two draft actors, faults."""
from __future__ import annotations

import time

import pytest
import ray

from actors.model.loader import load_model
from cluster.engine.build import local_engine
from cluster.engine.config import EngineConfig
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.spec_cluster import SpecCluster
from tests.cluster.ray_fixtures import ray_four_gpus  # noqa: F401  (module-scoped fixture)
from tests.cluster.runtime.cluster_requests import NEW_TOKENS, UNPLANNED, expected, requests, run_while  # noqa: F401  (fixture)
from tests.conftest import IdTokenizer


@pytest.fixture(scope="module")
def cluster(ray_four_gpus, tiny_model_dir):
    engine = EngineConfig(model=str(tiny_model_dir), dtype="float32", method="draft", draft="layer-skip:2", draft_width=2,
                          max_sequences=4, max_len=256, pipeline=True, **UNPLANNED)
    spec = ClusterSpec(engine=engine, tensor_parallel_size=2, num_draft_actors=2)
    cluster = SpecCluster(spec).start()
    yield cluster
    cluster.shutdown()


def test_cluster_output_equals_plain_decoding(cluster, expected):
    outputs = cluster.generate(requests(), timeout_s=120)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.stats.accepted for o in outputs) > 0
    assert cluster.loops[0].engine.counters.draft_failures == 0


def test_a_dead_draft_actor_loses_no_output(cluster, tiny_model_dir):
    engine = local_engine(load_model(tiny_model_dir), IdTokenizer(), None)
    long_expected = [o.token_ids for o in engine.generate(requests("p", NEW_TOKENS * 4))]
    victim = cluster.drafters[0].actor
    outputs = run_while(cluster, lambda: ray.kill(victim, no_restart=False), "d")
    assert [o.token_ids for o in outputs] == long_expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert cluster.loops[0].engine.counters.draft_failures >= 1
    deadline = time.time() + 60  # the actor comes back by itself
    while time.time() < deadline:
        try:
            assert ray.get(victim.ping.remote(), timeout=10)
            break
        except ray.exceptions.RayError:
            time.sleep(1)
    else:
        pytest.fail("the draft actor did not restart")


def test_a_dead_target_shard_fails_its_requests_clearly_then_recovers(cluster, expected):
    group = cluster.target_groups[0]
    outputs = run_while(cluster, lambda: ray.kill(group._shards[1]), "t")
    assert all(o.finish_reason in ("error", "length") for o in outputs)
    failed = [o for o in outputs if o.finish_reason == "error"]
    assert failed and all("retry" in o.error for o in failed)
    assert cluster.target_groups[0] is not group  # rebuilt
    again = cluster.generate(requests("n"), timeout_s=120)
    assert [o.token_ids for o in again] == expected

