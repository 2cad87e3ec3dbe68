"""One draft actor serving two target groups, on a Ray cluster of its own (the TP cluster of
test_spec_cluster holds every fake GPU for its module)."""
from __future__ import annotations

from cluster.engine.config import EngineConfig
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.spec_cluster import SpecCluster
from tests.cluster.ray_fixtures import ray_four_gpus  # noqa: F401  (module-scoped fixture)
from tests.cluster.runtime.cluster_requests import UNPLANNED, expected, requests  # noqa: F401  (fixture)


def test_one_draft_actor_serves_every_target_group_without_running_out_of_slots(ray_four_gpus, tiny_model_dir,
                                                                                 expected):
    """Two target groups of 2 slots each share one draft-model actor: it holds 4 requests at once."""
    engine = EngineConfig(model=str(tiny_model_dir), dtype="float32", method="draft", draft="layer-skip:2",
                          max_sequences=2, max_len=256, **UNPLANNED)
    spec = ClusterSpec(engine=engine, num_target_groups=2, num_draft_actors=1)
    cluster = SpecCluster(spec).start()
    try:
        outputs = cluster.generate(requests("g"), timeout_s=120)
        failures = [loop.engine.counters.draft_failures for loop in cluster.loops]
    finally:
        cluster.shutdown()
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.stats.accepted for o in outputs) > 0
    assert failures == [0, 0]
