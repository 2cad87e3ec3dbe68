"""Several Ray nodes in one machine (`ray.cluster_utils.Cluster`), each with its own fake GPUs and a
role label as a KubeRay worker group would give it: placement by label, Serve replicas whose TP=2
target groups are packed on nodes of their own with their drafters on another, a node the
autoscaler adds while a placement waits, node loss.

The tests share one cluster and run in file order: the last ones add and remove nodes."""
from __future__ import annotations

import logging
import threading
import time

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from cluster.engine.config import EngineConfig
from cluster.runtime.placement import ClusterSpec, PlacementError, reserve
from cluster.runtime.spec_cluster import SpecCluster
from cluster.serve.app import AppArgs, SpecServer
from protos import specserve_pb2 as pb
from tests.cluster.ray_fixtures import free_port
from tests.cluster.runtime.cluster_requests import NEW_TOKENS, PROMPTS, UNPLANNED, expected, requests, run_while  # noqa: F401  (fixture)

ROLE = "specserve.io/role"
TARGET, DRAFT = {ROLE: "target"}, {ROLE: "draft"}


@pytest.fixture(scope="module")
def nodes():
    """A head without GPUs, two target nodes of 2 GPUs and one draft node of 2 GPUs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        # a lost node is declared dead after 2 missed health checks a second apart (Ray's default: 5 of 3 s)
        fast_death = {"health_check_period_ms": 1000, "health_check_failure_threshold": 2}
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 2, "num_gpus": 0, "_system_config": fast_death})
        try:
            targets = [cluster.add_node(num_cpus=1, num_gpus=2, labels=TARGET) for _ in range(2)]
            draft = cluster.add_node(num_cpus=1, num_gpus=2, labels=DRAFT)
            ray.init(address=cluster.address)
            cluster.wait_for_nodes()
            yield cluster, targets, draft
        finally:
            ray.shutdown()
            cluster.shutdown()


def bundle_nodes(group) -> list[str]:
    """The node id of each bundle of a placement group, in bundle order."""
    where = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return [where[index] for index in range(len(where))]


def generate_retrying(cluster, batch, timeout_s):
    """As a client does: a request that ends with a retryable error (the target is being rebuilt:
    Ray has yet to notice the node is gone and move its bundles) is sent again a little later."""
    deadline = time.monotonic() + timeout_s
    outputs = cluster.generate(batch, timeout_s=timeout_s)
    while any(o.finish_reason == "error" for o in outputs):
        assert all("retry" in o.error for o in outputs if o.finish_reason == "error")
        assert time.monotonic() < deadline, "the target group was not rebuilt in time"
        time.sleep(2)
        outputs = cluster.generate(batch, timeout_s=timeout_s)
    return outputs


def tiny_engine(model_dir, **fields) -> EngineConfig:
    """The tiny target drafted by its own first layers, trees verified as drafted."""
    return EngineConfig(model=str(model_dir), method="draft", draft="layer-skip:2", max_sequences=4, max_len=256,
                        **UNPLANNED, **fields)


def labelled_spec(**fields) -> ClusterSpec:
    defaults = dict(tensor_parallel_size=2, num_draft_actors=1, engine=EngineConfig(method="draft"),
                    target_node_labels=TARGET, draft_node_labels=DRAFT)
    return ClusterSpec(**{**defaults, **fields})


def test_labels_send_target_shards_and_drafters_to_their_nodes(nodes):
    _, targets, draft = nodes
    placement = reserve(labelled_spec(num_target_groups=2))
    try:
        groups = [bundle_nodes(group) for group in placement.target_groups]
        assert all(len(set(ranks)) == 1 for ranks in groups)  # each TP group packed on one node
        assert {ranks[0] for ranks in groups} == {node.node_id for node in targets}
        assert bundle_nodes(placement.drafts) == [draft.node_id]
    finally:
        placement.release()


def test_labels_no_node_carries_fail_at_once_naming_role_and_labels(nodes):
    spec = labelled_spec(draft_node_labels={ROLE: "big-draft"})
    start = time.monotonic()
    with pytest.raises(PlacementError) as error:
        reserve(spec)
    assert time.monotonic() - start < 3
    assert str(error.value) == (
        "draft actors need 1 GPUs (1 draft actors) on nodes labelled specserve.io/role=big-draft, which have 0 (0 alive)"
    )
    with pytest.raises(PlacementError, match="no alive node of nodes labelled specserve.io/role=target can hold a whole "
                       r"target group \(4 GPU\)"):
        reserve(labelled_spec(tensor_parallel_size=4, num_draft_actors=0, engine=EngineConfig(method="none")))


def test_serve_places_each_replica_on_a_target_node_of_its_own(nodes, tiny_model_dir, expected):
    """Two replicas of the app: each reserves a TP=2 target group, which takes a whole target node (the
    second one the node the first left free), and a drafter on the draft node; both answer as plain
    decoding does, with drafts from the other node accepted.
    (Scaling by the speculation-aware policy is tested in tests/cluster/serve/test_live_scaling.py.)"""
    _, targets, draft = nodes
    args = AppArgs.model_validate({
        "cluster": {"engine": tiny_engine(tiny_model_dir), "tensor_parallel_size": 2, "target_node_labels": TARGET,
                    "draft_node_labels": DRAFT},
        "limits": {"max_prompt_tokens": 64, "max_new_tokens": 64},
    })
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()}, proxy_location="HeadOnly")
    try:
        deployment = SpecServer.options(num_replicas=2, ray_actor_options={"num_cpus": 0.1})
        handle = serve.run(deployment.bind(args), name="nodes", route_prefix="/")
        groups = [group for group in ray.util.placement_group_table().values() if group["state"] == "CREATED"]
        target_nodes = [set(g["bundles_to_node_id"].values()) for g in groups if g["strategy"] == "STRICT_PACK"]
        draft_nodes = [set(g["bundles_to_node_id"].values()) for g in groups if g["strategy"] == "SPREAD"]
        assert all(len(ids) == 1 for ids in target_nodes)  # each group packed on one node
        assert sorted(ids.pop() for ids in target_nodes) == sorted(node.node_id for node in targets)
        assert draft_nodes == [{draft.node_id}] * 2
        answers = [handle.Generate.remote(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                             sampling=pb.Sampling(max_new_tokens=NEW_TOKENS)))
                   for _ in range(2) for prompt in PROMPTS]
        replies = [answer.result() for answer in answers]
        assert [list(reply.token_ids) for reply in replies] == expected * 2
        assert sum(reply.stats.accepted for reply in replies) > 0  # drafted on the other node, and accepted
    finally:
        serve.shutdown()


def test_on_an_autoscaling_cluster_a_placement_waits_for_the_node_it_needs(nodes, caplog):
    """No node carries the label: the placement is logged as pending within seconds and is reserved
    as soon as a node with it joins (what the Ray autoscaler does for a pending placement group)."""
    cluster = nodes[0]
    spec = labelled_spec(draft_node_labels={ROLE: "new-draft"}, autoscaling_cluster=True, placement_timeout_s=120)
    result = {}
    caplog.set_level(logging.WARNING, logger="cluster.runtime.placement")
    waiter = threading.Thread(target=lambda: result.update(placement=reserve(spec)))
    waiter.start()
    deadline = time.monotonic() + 30
    while "placement groups pending" not in caplog.text:
        assert time.monotonic() < deadline and waiter.is_alive(), caplog.text
        time.sleep(0.2)
    assert "waiting up to 120 s for the autoscaler" in caplog.text
    assert "draft actors need 1 GPUs (1 draft actors) on nodes labelled specserve.io/role=new-draft" in caplog.text
    assert "draft group" in caplog.text.split("placement groups pending")[1]
    added = cluster.add_node(num_cpus=1, num_gpus=1, labels={ROLE: "new-draft"})
    try:
        waiter.join(60)
        assert not waiter.is_alive()
        placement = result["placement"]
        assert bundle_nodes(placement.drafts) == [added.node_id]
        placement.release()
    finally:
        cluster.remove_node(added)


def test_losing_a_target_node_fails_only_its_requests_and_rebuilds_on_a_node_with_room(nodes, tiny_model_dir, expected):
    ray_cluster, targets, _ = nodes
    engine = tiny_engine(tiny_model_dir, rebuild_retry_s=2.0)
    cluster = SpecCluster(labelled_spec(engine=engine, placement_timeout_s=60)).start()
    try:
        before = bundle_nodes(cluster.placement.target_groups[0])[0]
        lost = next(node for node in targets if node.node_id == before)
        outputs = run_while(cluster, lambda: ray_cluster.remove_node(lost, allow_graceful=False), "lost")
        assert all(o.finish_reason in ("error", "length") for o in outputs)  # every request answered
        failed = [o for o in outputs if o.finish_reason == "error"]
        assert failed and all("retry" in o.error for o in failed)
        again = generate_retrying(cluster, requests("after"), timeout_s=300)
        assert [o.token_ids for o in again] == expected
        after = bundle_nodes(cluster.placement.target_groups[0])
        assert set(after) == {next(node.node_id for node in targets if node is not lost)}
    finally:
        cluster.shutdown()
