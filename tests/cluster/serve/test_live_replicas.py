"""The Serve app on CPU with a tiny model and two replicas: a replica that dies mid-stream fails its
in-flight requests cleanly while new ones succeed, request bytes that do not parse are
INVALID_ARGUMENT, and HTTPS is served from Serve's own options. (Scaling from one replica to two by
the speculation-aware policy is tested on several nodes, in tests/cluster/runtime/test_multi_node.py.)"""
from __future__ import annotations

import http.client
import json
import ssl
import threading
import time

import grpc
import pytest
import ray
from ray import serve

from actors.model.loader import load_model
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.request import GenerationRequest
from cluster.serve.app import AppArgs, SpecServer
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc
from tests.cluster.ray_fixtures import channel, free_port, serve_on_local_ray  # noqa: F401  (channel: a fixture)
from tests.conftest import IdTokenizer

pytestmark = pytest.mark.default_model  # the tiny model directory borrows the default model's tokenizer
APP = "replicas"
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [3] * 12, list(range(10, 40)), [5, 6, 5, 6, 5], [20, 21, 22, 23]]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    engine = local_engine(load_model(tiny_model_dir), IdTokenizer(), None, SchedulerConfig(max_len=128))
    requests = [GenerationRequest(f"p{i}", p, max_new_tokens=NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    return [o.token_ids for o in engine.generate(requests)]


@pytest.fixture(scope="module")
def ports(tiny_model_dir, self_signed_cert):
    """(gRPC port, HTTPS port) of the app; its HTTP proxy takes TLS from Serve's http_options."""
    grpc_port, https_port = free_port(), free_port()
    certfile, keyfile = self_signed_cert
    https = {"host": "127.0.0.1", "port": https_port, "ssl_certfile": str(certfile), "ssl_keyfile": str(keyfile)}
    with serve_on_local_ray(grpc_port, https):
        args = AppArgs.model_validate({
            "cluster": {"engine": {"model": str(tiny_model_dir), "dtype": "float32", "method": "pld", "max_sequences": 2,
                                   "max_len": 128},
                        "gpus_per_target_shard": 0, "gpus_per_draft_actor": 0},
            "limits": {"max_prompt_tokens": 64, "max_new_tokens": 64, "max_concurrent_requests": 16},
        })
        deployment = SpecServer.options(num_replicas=2, max_ongoing_requests=16, ray_actor_options={"num_cpus": 0.1})
        serve.run(deployment.bind(args), name=APP, route_prefix="/")
        yield grpc_port, https_port


@pytest.fixture(scope="module")
def stub(channel):
    return specserve_pb2_grpc.SpecServeStub(channel)


def request(index: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[index]), sampling=pb.Sampling(max_new_tokens=NEW_TOKENS))


class Clients:
    """Threads that stream greedy requests back to back until stopped, keeping every answer."""

    def __init__(self, stub, count: int):
        self.stub, self.stop, self.answers, self.errors = stub, threading.Event(), [], []
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(count)]
        for thread in self.threads:
            thread.start()

    def _run(self, k: int) -> None:
        n = k
        while not self.stop.is_set():
            index = n % len(PROMPTS)
            try:
                chunks = list(self.stub.GenerateStream(request(index), timeout=120))
                self.answers.append((index, [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason))
            except grpc.RpcError as error:
                self.errors.append(error.code())
            n += 1

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)


def test_a_replica_that_dies_fails_its_streams_cleanly_and_new_requests_succeed(stub, expected):
    clients = Clients(stub, 4)
    try:
        while not clients.answers:
            time.sleep(0.2)
        replicas = [name for name in ray.util.list_named_actors(all_namespaces=True)
                    if "SERVE_REPLICA" in name["name"] and "SpecServer" in name["name"]]
        victim = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
        ray.kill(victim, no_restart=True)
        time.sleep(3)
    finally:
        clients.join()
    # Serve's gRPC proxy (Ray 2.60) reports a stream whose replica died as INTERNAL, not UNAVAILABLE
    assert set(clients.errors) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL}, clients.errors
    assert all(ids == expected[index] for index, ids, _ in clients.answers)  # nothing cut short or garbled
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            chunks = list(stub.GenerateStream(request(0), timeout=60))
            break
        except grpc.RpcError:
            time.sleep(1)
    assert [t for c in chunks for t in c.token_ids] == expected[0]


def test_request_bytes_that_do_not_parse_are_invalid_argument(channel):
    raw = channel.unary_unary("/specserve.SpecServe/Generate")
    good = request(0).SerializeToString()
    with pytest.raises(grpc.RpcError) as refused:
        raw(pb.GenerateRequest(text="AB").SerializeToString().replace(b"AB", b"\xff\xfe"), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request" in refused.value.details()
    assert pb.GenerateResponse.FromString(raw(good, timeout=60)).token_ids  # the server is fine


def test_http_is_served_over_tls_from_serves_own_options(ports, self_signed_cert):
    context = ssl.create_default_context(cafile=str(self_signed_cert[0]))
    connection = http.client.HTTPSConnection("localhost", ports[1], context=context, timeout=60)
    connection.request("GET", "/v1/models")
    response = connection.getresponse()
    assert response.status == 200 and json.loads(response.read())["data"][0]["object"] == "model"
    connection.close()
