"""The Ray Serve application on CPU, driven over real ports by a gRPC client and the openai client."""
from __future__ import annotations

import http.client
import json
import threading
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray import serve

from cluster.engine.build import build_engine
from cluster.engine.config import EngineConfig
from cluster.engine.request import GenerationRequest
from cluster.serve.app import build_app
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc
from tests.cluster.ray_fixtures import ray_four_gpus, ready_lines, shared_serve  # noqa: F401  (module-scoped fixtures)

pytestmark = pytest.mark.default_model
PROMPT = "List the first five prime numbers, separated by commas:"
ARGS = {
    "cluster": {
        "engine": {"model": "smollm2-135m", "method": "pld", "max_sequences": 4, "max_len": 1024},
        "gpus_per_target_shard": 0, "gpus_per_draft_actor": 0,
    },
    "limits": {"max_prompt_tokens": 960, "max_new_tokens": 64, "max_concurrent_requests": 8},
}


@pytest.fixture(scope="module")
def ports(shared_serve):
    """(HTTP port, gRPC port) of the app, deployed to Serve on the shared Ray."""
    serve.run(build_app(ARGS), name="specserve", route_prefix="/")
    return shared_serve


@pytest.fixture(scope="module")
def stub(ports):
    channel = grpc.insecure_channel(f"127.0.0.1:{ports[1]}")
    yield specserve_pb2_grpc.SpecServeStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def plain_ids():
    """The target's own greedy output for PROMPT, decoded in this process."""
    engine, tokenizer = build_engine(EngineConfig(method="none", max_sequences=1, max_len=1024))
    return engine.generate([GenerationRequest("p", tokenizer.encode(PROMPT), max_new_tokens=24, speculate=False)])[0].token_ids


def text_request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, sampling=pb.Sampling(max_new_tokens=24, **sampling))


def test_unary_generate_is_lossless(stub, plain_ids):
    response = stub.Generate(text_request(), timeout=120)
    assert list(response.token_ids) == plain_ids
    assert response.text and response.finish_reason in ("stop", "length")
    assert response.stats.target_forwards >= 1 and response.stats.mean_accepted_tokens >= 1.0
    assert response.prompt_tokens > 0


def test_streaming_chunks_add_up_to_the_unary_answer(stub, plain_ids):
    chunks = list(stub.GenerateStream(text_request(), timeout=120))
    assert [t for c in chunks for t in c.token_ids] == plain_ids
    assert chunks[-1].finish_reason and chunks[-1].stats.target_forwards == len(chunks)
    assert "".join(c.text for c in chunks) == stub.Generate(text_request(), timeout=120).text


def test_chat_and_token_id_prompts(stub):
    chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Say hi.")]),
                              sampling=pb.Sampling(max_new_tokens=8))
    assert stub.Generate(chat, timeout=120).token_ids
    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 504, 3458]), sampling=pb.Sampling(max_new_tokens=4))
    assert len(stub.Generate(ids, timeout=120).token_ids) <= 4


@pytest.mark.parametrize("message,field", [
    (pb.GenerateRequest(text=PROMPT, sampling=pb.Sampling(temperature=-1)), "temperature"),
    (pb.GenerateRequest(text=PROMPT, sampling=pb.Sampling(max_new_tokens=100000)), "max_new_tokens"),
    (pb.GenerateRequest(sampling=pb.Sampling(max_new_tokens=4)), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10 ** 8])), "prompt"),
    (pb.GenerateRequest(text=PROMPT, speculation=pb.Speculation(method="draft")), "speculation.method"),
    (pb.GenerateRequest(text=PROMPT, speculation=pb.Speculation(lookahead="sideways")), "speculation.lookahead"),
], ids=["temperature", "max_new_tokens", "no-prompt", "token-id", "method", "lookahead"])
def test_bad_input_is_invalid_argument_naming_the_field(stub, message, field):
    for call in (stub.Generate, lambda m, timeout: list(stub.GenerateStream(m, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as caught:
            call(message, timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in caught.value.details()


def test_cancelled_stream_frees_the_request(stub):
    handle = serve.get_deployment_handle("SpecServer", "specserve")
    request = pb.GenerateRequest(text=PROMPT, sampling=pb.Sampling(max_new_tokens=64),
                                 speculation=pb.Speculation(method="off"))
    stream = stub.GenerateStream(request, timeout=120)
    next(stream)
    stream.cancel()
    deadline = time.time() + 30
    while time.time() < deadline:
        state = handle.engine_state.remote().result()
        if state == {"active": 0, "waiting": 0, "in_flight": 0}:
            break
        time.sleep(0.5)
    assert state == {"active": 0, "waiting": 0, "in_flight": 0}


def test_models_and_health(stub, ports):
    models = stub.ListModels(pb.ListModelsRequest(), timeout=30)
    assert [(m.id, m.speculation_method) for m in models.models] == [("smollm2-135m", "pld")]
    channel = grpc.insecure_channel(f"127.0.0.1:{ports[1]}")
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_http_health_needs_no_api_key(ports):
    connection = http.client.HTTPConnection("127.0.0.1", ports[0], timeout=30)
    connection.request("GET", "/health")
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())) == (200, {"status": "ok"})
    connection.close()


def test_the_deployed_app_keeps_its_docs_off_and_bounds_its_bodies_and_shares_without_keys(ports, stub):
    """Through Serve's proxies: /docs and /openapi.json are off, a body past limits.max_body_bytes is
    413, and a deployment without keys is one tenant (the second unauthenticated request finds the
    first one's prompt in the prefix cache)."""
    def call(method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", ports[0], timeout=120)
        try:
            connection.request(method, path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    assert call("GET", "/docs")[0] == 404 and call("GET", "/openapi.json")[0] == 404
    status, answer = call("POST", "/v1/completions", b'{"prompt": "' + b"x" * (3 * 2**20) + b'"}')
    assert status == 413 and json.loads(answer)["error"]["param"] == "body"
    long_prompt = " ".join(f"Shared fact {i} of the tenant-less deployment." for i in range(12))
    body = json.dumps({"prompt": long_prompt, "max_tokens": 2, "temperature": 0}).encode()
    cached = [json.loads(call("POST", "/v1/completions", body)[1])["usage"]["prompt_tokens_details"]["cached_tokens"]
              for _ in range(2)]
    assert cached[0] == 0 < cached[1]
    grpc_cached = stub.Generate(pb.GenerateRequest(text=long_prompt, sampling=pb.Sampling(max_new_tokens=2)), timeout=120)
    assert grpc_cached.stats.cached_prompt_tokens > 0  # gRPC, no metadata: the same one tenant


def test_the_first_replica_says_when_the_application_is_ready(ports):
    """One line with the ports in the replica's log (and on its stderr, which `serve run` shows)."""
    expected = f"specserve ready: model smollm2-135m, HTTP on 127.0.0.1:{ports[0]}, gRPC on {ports[1]} ("
    lines = ready_lines("specserve")
    assert len(lines) == 1 and expected in lines[0], lines


def test_grpc_and_http_at_once(stub, ports, plain_ids):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key="unused")
    results = {}

    def run(name, call):
        try:
            results[name] = call()
        except Exception as error:  # reported by the asserts below
            results[name] = error

    calls = {
        "http": lambda: client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=24, temperature=0),
        "grpc": lambda: stub.Generate(text_request(), timeout=120),
    }
    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert list(results["grpc"].token_ids) == plain_ids
    assert results["http"].choices[0].text == results["grpc"].text
    chat = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)


def test_the_replica_exposes_its_measured_cost_curve(stub):
    curves = serve.get_deployment_handle("SpecServer", "specserve").cost_curves.remote().result()
    assert len(curves) == 1 and curves[0]
    single = sorted((p["tokens"], p["seconds"]) for p in curves[0] if p["sequences"] == 1)
    assert single[0][0] == 1 and all(seconds > 0 for _, seconds in single)


def test_a_seed_gives_the_same_sample_over_grpc_and_http_with_speculation_on_or_off(stub, ports):
    """Sampled at temperature 0.8 with a seed: the same tokens from gRPC and HTTP, from repeated calls
    and with speculation off, while drafts were accepted on the way (so they could have changed it)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key="unused")
    for seed in (3, 42):
        sampling = {"temperature": 0.8, "seed": seed}
        grpc_on = [stub.Generate(text_request(**sampling), timeout=120) for _ in range(2)]
        grpc_off = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.Sampling(max_new_tokens=24, **sampling),
                                                    speculation=pb.Speculation(method="off")), timeout=120)
        http = [client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=24, extra_body=extra,
                                          **sampling).choices[0].text
                for extra in ({}, {"speculation": {"method": "off"}})]
        assert [list(r.token_ids) for r in grpc_on] == [list(grpc_off.token_ids)] * 2
        assert http == [grpc_off.text] * 2
        assert grpc_off.stats.drafted == 0
    assert sum(r.stats.accepted for r in grpc_on) > 0
