"""Several Ray nodes in one machine (`ray.cluster_utils.Cluster`), each with its own fake GPUs and a
role label as a KubeRay worker group would give it: placement by label, Serve scaling up to a
second replica whose TP=2 target group is packed on a node of its own, both drafting from one pool
on another node, a node the autoscaler adds while a placement waits, node loss.

The tests share one cluster and run in file order: the last ones add and remove nodes."""
from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from cluster.engine.config import EngineConfig
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.placement import PlacementError, pending_placements, reserve
from cluster.runtime.spec_cluster import SpecCluster
from cluster.serve.app import GRPC_SERVICERS, AppArgs, SpecServer
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc
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
    return EngineConfig(model=str(model_dir), dtype="float32", method="draft", draft="layer-skip:2", max_sequences=4, max_len=256,
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


def running_replicas(app: str) -> int:
    return serve.status().applications[app].deployments["SpecServer"].replica_states.get("RUNNING", 0)


def test_serve_scales_onto_the_free_target_node_and_its_replicas_draft_from_one_pool(nodes, tiny_model_dir, expected):
    """One replica to start; under load (streams over gRPC) the speculation-aware policy asks Serve
    for a second, whose TP=2 target group takes the target node the first left free. No stream
    fails while it starts. Both draft from one draft pool whose drafter is on the draft node, and
    answer as plain decoding does, drafts accepted."""
    _, targets, draft = nodes
    args = AppArgs.model_validate({
        "cluster": {"engine": tiny_engine(tiny_model_dir), "tensor_parallel_size": 2, "target_node_labels": TARGET,
                    "draft_node_labels": DRAFT,
                    "draft_pool": {"name": "nodes", "report_period_s": 0.5, "idle_shutdown_s": 2}},
        "limits": {"max_prompt_tokens": 64, "max_new_tokens": 64},
    })
    autoscaling = {
        "min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0, "downscale_delay_s": 3600,
        "look_back_period_s": 1, "metrics_interval_s": 0.5,
        "policy": {"policy_function": "cluster.serve.autoscaling:SpeculationAwarePolicy",
                   "policy_kwargs": {"target_ongoing_requests": 1, "max_speedup": 1}},  # 2 streams ask for 2
    }
    grpc_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()}, proxy_location="HeadOnly",
                grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICERS})
    # through the proxy, as a client: a handle in this process would push autoscaling metrics from a
    # thread of its own that outlives Serve and this cluster
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = specserve_pb2_grpc.SpecServeStub(channel)
    try:
        deployment = SpecServer.options(autoscaling_config=autoscaling, ray_actor_options={"num_cpus": 0.1})
        serve.run(deployment.bind(args), name="nodes", route_prefix="/")
        assert running_replicas("nodes") == 1
        requests = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.Sampling(max_new_tokens=NEW_TOKENS))
                    for prompt in PROMPTS]
        stop, answered, errors = threading.Event(), [], []

        def client(k: int) -> None:
            while not stop.is_set():
                try:
                    chunks = list(stub.GenerateStream(requests[k % len(PROMPTS)], timeout=120))
                    answered.append((k % len(PROMPTS), [t for chunk in chunks for t in chunk.token_ids]))
                except grpc.RpcError as error:
                    errors.append(error.code())

        clients = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for thread in clients:
            thread.start()
        try:
            deadline = time.monotonic() + 180
            while running_replicas("nodes") < 2:
                assert time.monotonic() < deadline, "Serve did not add the second replica"
                time.sleep(1)
        finally:
            stop.set()
            for thread in clients:
                thread.join(120)
        groups = [group for group in ray.util.placement_group_table().values() if group["state"] == "CREATED"]
        target_nodes = [set(g["bundles_to_node_id"].values()) for g in groups if "target group" in g["name"]]
        pool_nodes = [set(g["bundles_to_node_id"].values()) for g in groups if "draft pool nodes" in g["name"]]
        assert all(len(ids) == 1 for ids in target_nodes)  # each group packed on one node
        assert sorted(ids.pop() for ids in target_nodes) == sorted(node.node_id for node in targets)
        assert pool_nodes == [{draft.node_id}]  # one drafter for both replicas, on the draft node
        assert errors == [] and answered and all(ids == expected[index] for index, ids in answered)
        replies = [stub.Generate(request, timeout=120) for request in requests]
        assert [list(reply.token_ids) for reply in replies] == expected
        assert sum(reply.stats.accepted for reply in replies) > 0  # drafted on the other node, and accepted
    finally:
        channel.close()
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
    [pending] = pending_placements()  # what /health lists
    assert " draft actors (" in pending["group"] and pending["bundles"] == ["1 GPU"], pending
    assert pending["state"] in ("NO_RESOURCES", "INFEASIBLE"), pending
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
