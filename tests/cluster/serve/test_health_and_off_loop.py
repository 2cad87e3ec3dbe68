"""GET /health and Serve's health check while a target group is rebuilt, the API docs, and work
kept off the event loop: a grammar that takes long to compile holds up its own request only, and
the token strings of logprobs are built before the first request, on both front ends (HTTP routes
over uvicorn, and SpecServer's gRPC methods called without Ray)."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI
from grpc_health.v1 import health_pb2

from actors.model.loader import load_tokenizer
from actors.target_worker import TargetWorker
from actors.worker import LocalWorker
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.loop import EngineLoop
from cluster.engine.request import GenerationRequest
from cluster.engine.spec_engine import SpecEngine
from cluster.serve.app import SpecServer
from cluster.serve.models import ServedModels
from cluster.serve.openai_api import build_http_app, build_openai_router
from cluster.serve.service import ServiceLimits, SpecService
from protos import specserve_pb2 as pb
from speculators.lookahead import LookaheadConfig
from speculators.proposers.prompt_lookup import PromptLookupProposer
from tests.cluster.engine.test_engine_faults import answer, failing_target
from tests.cluster.serve.grpc_context import GrpcContext
from tests.cluster.serve.uvicorn_server import uvicorn_server
from tests.conftest import tiny_pair

pytestmark = pytest.mark.default_model

API_KEY = "test-key"
MODEL_ID = "tiny-llama"
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"
COMPILE_HELD_S = 15
"""How long the slow compile waits to be released: a front end that compiles on the event loop
stalls the other streams this long, and the tests below see it."""


@dataclass
class Served:
    service: SpecService
    loop: EngineLoop
    port: int


@pytest.fixture(scope="module")
def served(default_model_path):
    """A tiny random Llama with the default model's tokenizer, served by uvicorn on a free port."""
    tokenizer = load_tokenizer(default_model_path)
    model, _ = tiny_pair(dtype=torch.float64, vocab_size=len(tokenizer))
    engine = local_engine(model, tokenizer, PromptLookupProposer(), SchedulerConfig(max_len=512))
    loop = EngineLoop(engine, "health-test-engine")
    service = SpecService([loop], tokenizer, MODEL_ID, "pld", LookaheadConfig(), ServiceLimits(api_key=API_KEY))
    app = build_http_app(lambda: ServedModels([service]))  # as the deployment builds it
    with uvicorn_server(app, "health-test-server") as port:
        yield Served(service, loop, port)
    loop.stop()


def get(served: Served, path: str, key: str | None = None, raw: bool = False) -> tuple[int, dict | bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = connection.getresponse()
        body = response.read()
        return response.status, body if raw else json.loads(body)
    finally:
        connection.close()


# ---- /docs and /openapi.json -------------------------------------------------------------------


def test_the_api_docs_are_off_unless_configured_and_then_behind_the_key(served, monkeypatch):
    from cluster.serve.app import http_app

    assert (http_app.docs_url, http_app.redoc_url, http_app.openapi_url) == (None, None, None)  # FastAPI's own: open
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert get(served, path, API_KEY, raw=True)[0] == 404
    monkeypatch.setattr(served.service, "limits", served.service.limits.model_copy(update={"api_docs": True}))
    assert get(served, "/openapi.json")[0] == 401 and get(served, "/docs", raw=True)[0] == 401
    status, schema = get(served, "/openapi.json", API_KEY)
    assert status == 200 and "/v1/chat/completions" in schema["paths"] and "/openapi.json" not in schema["paths"]
    status, page = get(served, "/docs", API_KEY, raw=True)
    assert status == 200 and b"swagger" in page.lower()


# ---- /health -----------------------------------------------------------------------------------


def test_health_is_ok_without_an_api_key(served):
    assert get(served, "/health") == (200, {"status": "ok"})


def test_health_is_unavailable_while_an_engine_loop_is_dead(served, monkeypatch):
    monkeypatch.setattr(EngineLoop, "alive", property(lambda loop: False))
    status, body = get(served, "/health")
    assert (status, body["status"]) == (503, "unavailable")
    assert body["reason"] == "1 of 1 engine loops stopped"
    monkeypatch.undo()
    assert get(served, "/health") == (200, {"status": "ok"})


def test_health_lists_the_placements_waiting_for_room(served, monkeypatch):
    """On a Ray cluster, a replica or drafter being added whose placement group waits shows in every
    serving replica's /health (the placement module reads Ray's table; here it is given)."""
    import cluster.serve.openai_api as openai_api

    waiting = [{"group": "smollm2 target group 0 (5c0f3e)", "bundles": ["1 GPU", "1 GPU"], "state": "NO_RESOURCES"}]
    monkeypatch.setattr(openai_api.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(openai_api, "pending_placements", lambda: waiting)
    assert get(served, "/health") == (200, {"status": "ok", "pending_placements": waiting})


def test_health_reads_rays_placement_table_at_most_once_a_second(served, monkeypatch):
    """Probes come every few seconds from every load balancer and kubelet; the table is cluster-wide."""
    import cluster.serve.openai_api as openai_api

    calls = []
    monkeypatch.setattr(openai_api.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(openai_api, "pending_placements", lambda: calls.append(time.monotonic()) or [])
    monkeypatch.setattr(openai_api, "PLACEMENTS_TTL_S", 0.5)
    app = FastAPI()
    app.include_router(build_openai_router(lambda: ServedModels([served.service])))
    with uvicorn_server(app, "health-cached") as port:
        probe = Served(served.service, served.loop, port)
        began = time.monotonic()
        while time.monotonic() - began < 0.3:
            assert get(probe, "/health") == (200, {"status": "ok"})
        assert len(calls) == 1
        time.sleep(0.6)
        assert get(probe, "/health") == (200, {"status": "ok"}) and len(calls) == 2


def test_a_rebuild_that_outlasts_serves_health_checks_is_not_ready_yet_healthy(served):
    """Serve replaces a replica after REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD failed checks (every
    health_check_period_s, 10 s), and a large group reloading its weights takes longer. The checks run
    here as Serve runs them, a short period apart, while the rebuild is held past that many: none
    fails, while readiness (HTTP and gRPC) says not serving; then it serves again."""
    from ray.serve._private.constants import REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD

    tokenizer, period_s = served.service.tokenizer, 0.2
    model, _ = tiny_pair(dtype=torch.float64, vocab_size=len(tokenizer))
    rebuilding, released = threading.Event(), threading.Event()

    def rebuild():
        rebuilding.set()
        released.wait(60)
        return LocalWorker(TargetWorker(model, 4, 256))

    config = SchedulerConfig(max_sequences=4, max_len=256)
    engine = SpecEngine(LocalWorker(failing_target(model, "verify")), tokenizer, [], config, vocab_size=len(tokenizer),
                        rebuild_target=rebuild)
    loop = EngineLoop(engine, "slow-rebuild-engine")
    service = SpecService([loop], tokenizer, MODEL_ID, "pld", LookaheadConfig(), ServiceLimits(api_key=API_KEY))
    server = object.__new__(next(cls for cls in SpecServer.func_or_class.__mro__ if "_request" in vars(cls)))
    server.clusters, server.models = [SimpleNamespace(loops=[loop])], ServedModels([service])

    def grpc_status():
        return asyncio.run(server.Check(health_pb2.HealthCheckRequest(), GrpcContext(None))).status

    prompt = tokenizer.encode(PROMPT)
    try:
        with uvicorn_server(build_http_app(lambda: server.models), "slow-rebuild-server") as port:
            probe = Served(service, loop, port)
            failed = answer(loop, GenerationRequest("failed", prompt, max_new_tokens=4))
            assert rebuilding.wait(30)
            began = time.monotonic()
            for _ in range(REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD + 2):
                server.check_health()  # healthy: it can recover
                status, body = get(probe, "/health")
                assert (status, body["reason"]) == (503, "1 of 1 target groups are being rebuilt")
                assert grpc_status() == health_pb2.HealthCheckResponse.NOT_SERVING
                time.sleep(period_s)
            assert time.monotonic() - began > REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD * period_s
            released.set()
            assert failed.result(30).finish_reason == "error"
            deadline = time.monotonic() + 30
            while not loop.ready:
                assert time.monotonic() < deadline, "the rebuilt target does not serve"
                time.sleep(0.05)
            server.check_health()
            assert get(probe, "/health") == (200, {"status": "ok"})
            assert grpc_status() == health_pb2.HealthCheckResponse.SERVING
            again = answer(loop, GenerationRequest("again", prompt, max_new_tokens=4)).result(60)
            assert again.finish_reason in ("stop", "length") and len(again.token_ids) == 4
    finally:
        released.set()
        loop.stop()


def test_health_is_unavailable_before_the_replica_serves():
    def not_yet():
        raise RuntimeError("no replica context")

    app = FastAPI()
    app.include_router(build_openai_router(not_yet))
    with uvicorn_server(app, "health-not-serving") as port:
        status, body = get(Served(None, None, port), "/health")
    assert (status, body["status"]) == (503, "unavailable") and "no replica context" in body["reason"]


# ---- a slow grammar compile holds up its own request only --------------------------------------


class HeldCompile:
    """Replaces the service's grammar compiler for one test: compiling waits until released."""

    def __init__(self, service: SpecService, monkeypatch):
        self.entered, self.released, self.returned = threading.Event(), threading.Event(), threading.Event()
        compiler = service.grammars
        real = compiler._compile

        def held(spec):
            self.entered.set()
            self.released.wait(COMPILE_HELD_S)
            try:
                return real(spec)
            finally:
                self.returned.set()

        monkeypatch.setattr(compiler, "_compile", held)

    def wait_until_compiling(self) -> None:
        assert self.entered.wait(30), "the structured-output request never reached its compile"


def sse_lines(response: http.client.HTTPResponse):
    """The data of each server-sent event, as it comes."""
    while line := response.readline():
        if line.startswith(b"data: "):
            yield line[6:].strip()


def open_stream(served: Served, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    response = connection.getresponse()
    assert response.status == 200
    return connection, response


def test_http_streams_go_on_while_a_grammar_compiles(served, monkeypatch):
    held = HeldCompile(served.service, monkeypatch)
    plain = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True,
             "speculation": {"method": "off"}}
    connection, running = open_stream(served, plain)  # a stream under way before the slow request comes
    events = sse_lines(running)
    assert next(events) != b"[DONE]"
    result = {}

    def constrained():  # a spec no other test compiles, so the compiler's cache does not have it
        status, body = 0, b""
        try:
            connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
            connection.request("POST", "/v1/completions", json.dumps(
                {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                 "structured_outputs": {"regex": "(held|http){1,3}"}}),
                {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
            response = connection.getresponse()
            status, body = response.status, response.read()
        finally:
            result["constrained"] = (status, body)

    slow = threading.Thread(target=constrained)
    slow.start()
    try:
        held.wait_until_compiling()
        rest = list(events)  # the running stream goes on to its end
        connection.close()
        assert rest[-1] == b"[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] in ("stop", "length")
        fresh_connection, fresh = open_stream(served, plain | {"max_tokens": 8})  # and a new one runs whole
        assert list(sse_lines(fresh))[-1] == b"[DONE]"
        fresh_connection.close()
        assert not held.returned.is_set(), "the streams waited for the compile"
    finally:
        held.released.set()
        slow.join(60)
    status, body = result["constrained"]
    assert status == 200, body
    assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")


def test_grpc_streams_go_on_while_a_grammar_compiles(served, monkeypatch):
    """SpecServer's gRPC methods, called as Serve's gRPC proxy calls them (no Ray here)."""
    held = HeldCompile(served.service, monkeypatch)
    servable = next(cls for cls in SpecServer.func_or_class.__mro__ if "_request" in vars(cls))  # not Serve's wrapper
    server = object.__new__(servable)  # no __init__: the replica's models only
    server.models = ServedModels([served.service])
    context = GrpcContext(API_KEY)
    plain = pb.GenerateRequest(text=PROMPT, sampling=pb.Sampling(max_new_tokens=200),
                               speculation=pb.Speculation(method="off"))
    constrained = pb.GenerateRequest(text=PROMPT, sampling=pb.Sampling(max_new_tokens=4),
                                     structured_output=pb.StructuredOutput(kind="regex", value="(held|grpc){1,3}"))

    async def scenario():
        running = server.GenerateStream(plain, context)
        first = await anext(running)
        assert first.token_ids and not first.finish_reason
        slow = asyncio.ensure_future(server.Generate(constrained, context))
        await asyncio.to_thread(held.wait_until_compiling)
        rest = [chunk async for chunk in running]  # the running stream goes on to its end
        fresh = [chunk async for chunk in server.GenerateStream(plain, context)]  # and a new one runs whole
        compiling = not held.returned.is_set()
        held.released.set()
        return rest, fresh, compiling, await slow

    try:
        rest, fresh, compiling, answer = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        held.released.set()
    assert rest[-1].finish_reason in ("stop", "length") and fresh[-1].finish_reason in ("stop", "length")
    assert compiling, "the streams waited for the compile"
    assert answer.finish_reason in ("stop", "length") and answer.token_ids and context.code is None


def test_the_token_strings_of_logprobs_are_not_built_on_the_event_loop(served, monkeypatch):
    """Building them serialises and parses the whole tokenizer: on the loop, every stream would wait."""
    import cluster.serve.requests as requests_module

    on_loop = []

    class Recorded(requests_module.TokenStrings):
        def __init__(self, tokenizer):
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
            super().__init__(tokenizer)

    monkeypatch.setattr(requests_module, "TokenStrings", Recorded)
    service = SpecService([served.loop], served.service.tokenizer, MODEL_ID, "pld", LookaheadConfig(),
                          ServiceLimits(api_key=API_KEY))
    server = object.__new__(next(cls for cls in SpecServer.func_or_class.__mro__ if "_request" in vars(cls)))
    server.models = ServedModels([service])
    with uvicorn_server(build_http_app(lambda: ServedModels([service])), "logprobs-off-loop") as port:
        connection, response = open_stream(Served(service, served.loop, port), {
            "model": MODEL_ID, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2, "stream": True})
        assert list(sse_lines(response))[-1] == b"[DONE]"
        connection.close()
    answer = asyncio.run(server.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.Sampling(
        max_new_tokens=3, logprobs=2)), GrpcContext(API_KEY)))
    assert answer.logprobs and answer.logprobs[0].token
    assert on_loop == [False]  # built once, at the service's start
