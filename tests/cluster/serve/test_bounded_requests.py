"""Every request is bounded before it costs much: its body's bytes (413), its chat messages (400
naming `messages`) and its grammar's compile time (400 naming the field that gave it), compiles on
threads of their own and awaited on the event loop, so slow ones starve no parsing; every limit is in
`limits.*` with a description. A tiny model served by uvicorn
(HTTP) and SpecServer's gRPC methods called without Ray."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading
import time

import grpc
import pytest
import torch
from fastapi import FastAPI

from actors.model.loader import load_tokenizer
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.loop import EngineLoop
from cluster.serve.models import ServedModels
from cluster.serve.openai_api import build_openai_router
from cluster.serve.service import ServiceLimits, SpecService
from protos import specserve_pb2 as pb
from speculators.lookahead import LookaheadConfig
from speculators.proposers.prompt_lookup import PromptLookupProposer
from tests.cluster.serve.test_tenants import GrpcContext, grpc_server
from tests.cluster.serve.uvicorn_server import uvicorn_server
from tests.conftest import tiny_pair

pytestmark = pytest.mark.default_model

MODEL_ID = "tiny-llama"
LIMITS = ServiceLimits(max_body_bytes=4096, max_messages=3, grammar_compile_timeout_s=1.0)


@pytest.fixture(scope="module")
def served(default_model_path):
    tokenizer = load_tokenizer(default_model_path)
    model, _ = tiny_pair(dtype=torch.float64, vocab_size=len(tokenizer))
    loop = EngineLoop(local_engine(model, tokenizer, PromptLookupProposer(), SchedulerConfig(max_len=512)), "bounded")
    service = SpecService([loop], tokenizer, MODEL_ID, "pld", LookaheadConfig(), LIMITS)
    app = FastAPI()
    app.include_router(build_openai_router(lambda: ServedModels([service])))
    with uvicorn_server(app, "bounded-requests") as port:
        yield service, port
    loop.stop()


def post(port: int, path: str, body: bytes | object, chunked: bool = False) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        if chunked:  # no Content-Length: the server must stop reading at the cap by itself
            connection.request("POST", path, iter([data[i:i + 1000] for i in range(0, len(data), 1000)]),
                               {"Content-Type": "application/json"}, encode_chunked=True)
        else:
            connection.request("POST", path, data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_cap_is_refused_with_413(served, chunked):
    _, port = served
    status, answer = post(port, "/v1/completions", {"model": MODEL_ID, "prompt": "x" * 5000, "max_tokens": 1}, chunked)
    assert status == 413 and answer["error"]["param"] == "body" and "limits.max_body_bytes" in answer["error"]["message"]
    status, _ = post(port, "/v1/completions", {"model": MODEL_ID, "prompt": "x" * 100, "max_tokens": 1}, chunked)
    assert status == 200


def test_too_many_messages_are_refused_naming_the_field(served):
    _, port = served
    messages = [{"role": "user", "content": "hi"}] * 4
    status, answer = post(port, "/v1/chat/completions", {"model": MODEL_ID, "messages": messages, "max_tokens": 1})
    assert status == 400 and answer["error"]["param"] == "messages" and "limit is 3" in answer["error"]["message"]
    assert post(port, "/v1/chat/completions", {"model": MODEL_ID, "messages": messages[:3], "max_tokens": 1})[0] == 200


class SlowCompile:
    """Compiling waits until released (at most HELD_S), and says which thread compiled."""

    HELD_S = 20

    def __init__(self, service: SpecService, monkeypatch):
        self.released, self.threads = threading.Event(), []
        compiler = service.grammars
        real = compiler._compile

        def slow(spec):
            self.threads.append(threading.current_thread().name)
            self.released.wait(self.HELD_S)
            return real(spec)

        monkeypatch.setattr(compiler, "_compile", slow)


def test_a_grammar_past_its_compile_deadline_is_refused_naming_its_field(served, monkeypatch):
    service, port = served
    slow = SlowCompile(service, monkeypatch)
    schema = {"type": "object", "properties": {"slow": {"type": "integer"}}}
    try:
        began = time.monotonic()
        status, answer = post(port, "/v1/chat/completions", {
            "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
        assert status == 400 and answer["error"]["param"] == "response_format", answer
        assert "limits.grammar_compile_timeout_s" in answer["error"]["message"] and time.monotonic() - began < 10
        context = GrpcContext(None)
        asyncio.run(grpc_server(service).Generate(pb.GenerateRequest(
            text="hi", structured_output=pb.StructuredOutput(kind="regex", value="(slow|grpc)+")), context))
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith("structured_output:")
    finally:
        slow.released.set()
    assert slow.threads and all(name.startswith("grammar-compile") for name in slow.threads)


def test_slow_compiles_hold_none_of_the_threads_that_parse_requests(served, monkeypatch):
    """More requests waiting on slow compiles than the event loop's default executor has threads (where
    requests are parsed): a plain request is still parsed and answered while every one of them waits."""
    service, port = served
    monkeypatch.setattr(service, "limits", service.limits.model_copy(update={"grammar_compile_timeout_s": 30.0}))
    slow = SlowCompile(service, monkeypatch)
    waiting = min(32, (os.cpu_count() or 1) + 4) + 4  # ThreadPoolExecutor's default size, and more
    asked = service.grammars.cache_info()["misses"] + waiting
    answers: list[tuple[int, dict]] = []

    def constrained(index: int) -> None:
        answers.append(post(port, "/v1/completions", {
            "model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": f"(starve{index})+"}}))

    clients = [threading.Thread(target=constrained, args=(index,), daemon=True) for index in range(waiting)]
    try:
        for client in clients:
            client.start()
        until = time.monotonic() + 10
        while service.grammars.cache_info()["misses"] < asked and time.monotonic() < until:
            time.sleep(0.05)
        status, answer = post(port, "/v1/completions", {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2})
        assert status == 200, answer
        assert not answers, "a plain request waited for slow compiles"
        assert service.grammars.cache_info()["misses"] == asked  # every slow one was parsed and is waiting
    finally:
        slow.released.set()
        for client in clients:
            client.join(60)
    assert sorted(status for status, _ in answers) == [200] * waiting, answers


def test_every_limit_has_a_description():
    assert all(field.description for field in ServiceLimits.model_fields.values())


def test_a_grpc_request_over_the_cap_is_refused_naming_it(served):
    service, _ = served
    context = GrpcContext(None)
    asyncio.run(grpc_server(service).Generate(pb.GenerateRequest(text="x" * 5000), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "limits.max_body_bytes" in context.details
    assert context.details.startswith("request:")


def test_a_prompt_and_its_max_tokens_must_fit_the_context_window(served):
    """As vLLM holds a request to max_model_len: prompt + max_tokens over max_len (512 here) is a 400
    naming max_tokens, a prompt alone filling the window one naming prompt, and a request that gives
    no max_tokens gets what fits."""
    _, port = served
    status, answer = post(port, "/v1/completions", {"model": MODEL_ID, "prompt": [7] * 500, "max_tokens": 13})
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer
    assert "500 tokens" in answer["error"]["message"] and "at most 12" in answer["error"]["message"]
    status, answer = post(port, "/v1/completions", {"model": MODEL_ID, "prompt": [7] * 500, "max_tokens": 12})
    assert status == 200 and answer["usage"]["completion_tokens"] <= 12
    status, answer = post(port, "/v1/completions", {"model": MODEL_ID, "prompt": [7] * 512, "max_tokens": 1})
    assert status == 400 and answer["error"]["param"] == "prompt" and "limit is 511" in answer["error"]["message"]
    status, answer = post(port, "/v1/completions", {"model": MODEL_ID, "prompt": [7] * 508})
    assert status == 200 and 1 <= answer["usage"]["completion_tokens"] <= 4, answer
