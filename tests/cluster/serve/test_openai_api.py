"""The OpenAI-compatible routes end to end: a real uvicorn server driven by the official client."""
from __future__ import annotations

import http.client
import inspect
import itertools
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from fastapi import FastAPI

from actors.model.loader import load_tokenizer
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.loop import EngineLoop
from cluster.engine.request import GenerationRequest
from cluster.engine.spec_engine import SpecEngine
from cluster.serve.models import ServedModels
from cluster.serve.openai_api import build_openai_router
from cluster.serve.openai_schema import CHAT_FIELDS, COMPLETION_FIELDS, IGNORED_FIELDS, NEUTRAL_ONLY
from cluster.serve.service import ServiceLimits, SpecService
from speculators.lookahead import LookaheadConfig
from speculators.proposers.prompt_lookup import PromptLookupProposer
from tests.cluster.serve.uvicorn_server import uvicorn_server
from tests.conftest import tiny_pair

pytestmark = pytest.mark.default_model

API_KEY = "test-key"
MODEL_ID = "tiny-llama"
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to the cat."}]
MAX_TOKENS = 40


@dataclass
class Served:
    service: SpecService
    loop: EngineLoop
    reference: SpecEngine
    """Plain decoding (no drafter) of the same model, in this thread."""
    port: int

    @property
    def tokenizer(self):
        return self.service.tokenizer

    def greedy_text(self, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        """What a temperature-0 answer must say (speculation is lossless), and its token count."""
        output = self.reference.generate([GenerationRequest("expected", list(prompt_ids), max_new_tokens=max_tokens)])[0]
        return self.tokenizer.decode(output.token_ids, skip_special_tokens=True), len(output.token_ids)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def served(default_model_path):
    """A tiny random Llama with the default model's full tokenizer, served by uvicorn on a free port.

    Not `tiny_model_dir`: its 64-token vocabulary cannot take text prompts, and it lacks the chat
    template. float64 keeps greedy argmax identical between tree verification and plain decoding.
    """
    tokenizer = load_tokenizer(default_model_path)
    model, _ = tiny_pair(dtype=torch.float64, vocab_size=len(tokenizer))
    config = SchedulerConfig(max_len=512)
    loop = EngineLoop(local_engine(model, tokenizer, PromptLookupProposer(), config), "openai-test-engine")
    service = SpecService([loop], tokenizer, MODEL_ID, "pld", LookaheadConfig(), ServiceLimits(api_key=API_KEY))
    app = FastAPI()
    app.include_router(build_openai_router(lambda: ServedModels([service])))
    with uvicorn_server(app, "openai-test-server") as port:
        yield Served(service, loop, local_engine(model, tokenizer, None, config), port)
    loop.stop()


def connect(served: Served, path: str, body: bytes, timeout: float = 30) -> http.client.HTTPConnection:
    """A raw POST (no OpenAI client), for what the client hides: the wire format, bad JSON, hanging up."""
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=timeout)
    connection.request("POST", path, body, {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    return connection


def post(served: Served, path: str, body: bytes) -> tuple[int, http.client.HTTPMessage, bytes]:
    connection = connect(served, path, body)
    try:
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def wait_for(condition, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- answers -----------------------------------------------------------------------------------


def test_models_lists_the_served_model(served):
    models = served.client().models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL_ID, "model", "specserve")]


@pytest.mark.parametrize("form", ["text", "one-text-batch", "token-ids"])
def test_completion_equals_greedy_decoding(served, form):
    ids = served.tokenizer.encode(PROMPT)
    prompt = {"text": PROMPT, "one-text-batch": [PROMPT], "token-ids": ids}[form]
    response = served.client().completions.create(model=MODEL_ID, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    text, count = served.greedy_text(ids)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason, response.object, response.model) == (text, "length", "text_completion", MODEL_ID)
    assert response.id.startswith("cmpl-")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == \
        (len(ids), count, len(ids) + count)
    speculation = response.model_extra["speculation"]
    assert speculation["drafted"] > 0 and 0 < speculation["target_forwards"] <= count
    assert speculation["mean_accepted_tokens"] == pytest.approx(count / speculation["target_forwards"])


@pytest.mark.parametrize("stop", [None, "cut-here"])
def test_streamed_completion_equals_non_streamed(served, stop):
    client = served.client()
    if stop == "cut-here":  # a stop string that occurs in the middle of the greedy text
        full, _ = served.greedy_text(served.tokenizer.encode(PROMPT))
        stop = full[len(full) // 2: len(full) // 2 + 4]
    whole = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=stop)
    chunks = list(client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stop=stop, stream=True, stream_options={"include_usage": True}))
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(c.text for c in choices) == whole.choices[0].text
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + [whole.choices[0].finish_reason]
    assert whole.choices[0].finish_reason == ("length" if stop is None else "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_completion_streamed_and_not(served):
    client = served.client()
    text, count = served.greedy_text(served.chat_ids(MESSAGES))
    whole = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    message = whole.choices[0].message
    assert (whole.object, message.role, message.content) == ("chat.completion", "assistant", text)
    assert whole.id.startswith("chatcmpl-") and whole.usage.completion_tokens == count
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_completion_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_takes_text_parts_and_the_developer_role(served):
    client, plain = served.client(), dict(model=MODEL_ID, max_tokens=8, temperature=0, n=1, user="someone")
    newer = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             MESSAGES[1]]
    assert client.chat.completions.create(messages=newer, **plain).choices[0].message.content == \
        client.chat.completions.create(messages=MESSAGES, **plain).choices[0].message.content


@pytest.mark.parametrize("speculation", [{"method": "off"}, {"lookahead": "fixed", "max_speculative_tokens": 3}])
def test_speculation_options_keep_the_greedy_text(served, speculation):
    response = served.client().completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                  extra_body={"speculation": speculation})
    assert response.choices[0].text == served.greedy_text(served.tokenizer.encode(PROMPT))[0]
    drafted = response.model_extra["speculation"]["drafted"]
    assert drafted == 0 if speculation.get("method") == "off" else drafted > 0


def test_seeded_sampling_repeats_and_streams_the_same(served):
    client, request = served.client(), dict(model=MODEL_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.8, seed=7)
    first, second = (client.completions.create(**request).choices[0].text for _ in range(2))
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**request, stream=True))
    assert first == second == streamed


def test_sampling_without_a_seed_uses_openais_default_temperature(served):
    response = served.client().completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=8)
    assert response.choices[0].finish_reason == "length"


def test_sse_wire_format(served):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    status, headers, raw = post(served, "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")[:-1]
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 9999}, "n"),
    ({"echo": True}, "echo"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"stream": "yes"}, "stream"),
    ({"extra_body": {"speculation": {"method": "draft"}}}, "speculation.method"),
    ({"extra_body": {"speculation": {"max_speculative_tokens": 999}}}, "speculation.max_speculative_tokens"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
])
def test_bad_completion_fields_are_named(served, fields, param):
    request = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4} | fields
    with pytest.raises(openai.BadRequestError) as error:
        served.client().completions.create(**request)
    assert error.value.param == param
    assert param in error.value.body["message"] and error.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("fields, param", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
])
def test_bad_chat_fields_are_named(served, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        served.client().chat.completions.create(**({"model": MODEL_ID, "messages": MESSAGES} | fields))
    assert error.value.param == param


def test_an_unknown_model_is_a_404_and_a_missing_one_the_served_one(served):
    with pytest.raises(openai.NotFoundError) as error:
        served.client().completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert (error.value.body["code"], error.value.body["param"]) == ("model_not_found", "model")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    status, _, raw = post(served, "/v1/completions", body)
    assert status == 200 and json.loads(raw)["model"] == MODEL_ID


@pytest.mark.parametrize("body", [b"[1, 2]", b"{not json"])
def test_a_body_that_is_no_json_object_is_a_400(served, body):
    status, _, raw = post(served, "/v1/completions", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == "body"


def test_a_wrong_api_key_is_refused(served):
    client = served.client(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4)


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_replica_answers_503(served, monkeypatch, stream):
    monkeypatch.setattr(served.service, "limits", served.service.limits.model_copy(update={"max_concurrent_requests": 0}))
    with pytest.raises(openai.APIStatusError) as error:
        served.client().completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4, stream=stream)
    assert error.value.status_code == 503 and error.value.response.headers["retry-after"]
    assert error.value.body["type"] == "overloaded"


def fail_engine_steps_after(monkeypatch, engine: SpecEngine, good_steps: int) -> None:
    """Make the engine's steps raise once `good_steps` steps have decoded (the loop then fails every
    active request, as when a worker dies)."""
    real_step, steps = engine.step, itertools.count()

    def step():
        if engine.active and next(steps) >= good_steps:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine, "step", step)


def test_a_failed_request_is_a_503(served, monkeypatch):
    fail_engine_steps_after(monkeypatch, served.loop.engine, 1)
    with pytest.raises(openai.InternalServerError) as error:
        served.client().completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert error.value.status_code == 503 and "internal engine error" in error.value.body["message"]


def test_a_stream_that_fails_midway_ends_with_an_error_event(served, monkeypatch):
    fail_engine_steps_after(monkeypatch, served.loop.engine, 3)
    stream = served.client().completions.create(model=MODEL_ID, prompt="Plain words here", max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, extra_body={"speculation": {"method": "off"}})
    with pytest.raises(openai.APIError, match="internal engine error"):
        list(stream)


# ---- clients that leave ------------------------------------------------------------------------


@pytest.fixture
def slow_engine_and_aborts(served, monkeypatch) -> Iterator[list[str]]:
    """Steps slowed to 20 ms (a long request outlives its client), and the ids the loop aborts."""
    engine, aborted = served.loop.engine, []
    real_step, real_abort = engine.step, served.loop.abort

    def slow_step():
        time.sleep(0.02)
        return real_step()

    def abort(request_id: str) -> None:
        aborted.append(request_id)
        real_abort(request_id)

    monkeypatch.setattr(engine, "step", slow_step)
    monkeypatch.setattr(served.loop, "abort", abort)
    yield aborted
    assert wait_for(lambda: served.service.in_flight == 0 and served.loop.load == 0), "the request was not released"


def test_a_client_leaving_a_stream_aborts_its_request(served, slow_engine_and_aborts):
    stream = served.client().completions.create(model=MODEL_ID, prompt="Plain words here", max_tokens=500, temperature=0,
                                                stream=True, extra_body={"speculation": {"method": "off"}})
    next(iter(stream))
    stream.close()
    assert wait_for(lambda: slow_engine_and_aborts, 5)


def test_a_client_leaving_a_plain_request_aborts_it(served, slow_engine_and_aborts):
    body = json.dumps({"prompt": "Plain words here", "max_tokens": 500, "temperature": 0,
                       "speculation": {"method": "off"}}).encode()
    connection = connect(served, "/v1/completions", body, timeout=0.5)
    with pytest.raises(TimeoutError):
        connection.getresponse()
    connection.close()
    assert wait_for(lambda: slow_engine_and_aborts, 5)


# ---- the compatibility table (docs/openai-compatibility.md, linked from the README) -------------

COMPATIBILITY_TABLE = Path(__file__).resolve().parents[3] / "docs" / "openai-compatibility.md"
TABLE_ROW = re.compile(r"^\| `([a-z_]+)` \| (completions|chat|both) \| (yes|extra|ignored|neutral only) \|", re.M)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
EXAMPLES = {
    "model": MODEL_ID, "prompt": PROMPT, "messages": MESSAGES, "max_tokens": 6, "max_completion_tokens": 6,
    "temperature": 0.5, "top_p": 0.9, "n": 2, "best_of": 2, "stop": ["\n"], "stream": True,
    "stream_options": {"include_usage": True}, "seed": 3, "logprobs": 2, "top_logprobs": 2,
    "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}},
    "top_k": 5, "repetition_penalty": 1.2, "structured_outputs": {"regex": "[ab]{3}"},
    "speculation": {"method": "off"}, "cache_salt": "salt",
    "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
    "parallel_tool_calls": False, "prompt_cache_key": "k", "safety_identifier": "s",
    "echo": True, "suffix": "x", "logit_bias": {"1": 2}, "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required", "functions": [{"name": "f"}], "function_call": {"name": "f"}, "modalities": ["audio"],
}
"""A value of each parameter: a real request for the served ones, a refused one for the neutral-only."""


def compatibility_table() -> dict[str, tuple[str, str]]:
    return {name: (endpoints, served) for name, endpoints, served in TABLE_ROW.findall(COMPATIBILITY_TABLE.read_text())}


def test_the_table_lists_every_parameter_the_server_reads():
    table = compatibility_table()
    known = COMPLETION_FIELDS | CHAT_FIELDS | IGNORED_FIELDS | set(NEUTRAL_ONLY)
    assert set(table) == known == set(EXAMPLES)
    for name, (endpoints, served) in table.items():
        assert (name in COMPLETION_FIELDS, name in CHAT_FIELDS) == \
            ({"both": (True, True), "completions": (True, False), "chat": (False, True)}[endpoints]
             if served in ("yes", "extra") else (False, False)), name
        assert (served == "ignored") == (name in IGNORED_FIELDS) and (served == "neutral only") == (name in NEUTRAL_ONLY)


def table_requests() -> list[tuple[str, bool]]:
    """(parameter, chat?) for every row of the table and every endpoint it names."""
    return [(name, chat) for name, (endpoints, _) in sorted(compatibility_table().items())
            for chat in {"both": (False, True), "completions": (False,), "chat": (True,)}[endpoints]]


@pytest.mark.parametrize("name,chat", table_requests(), ids=lambda v: str(v))
def test_every_row_of_the_table_holds_through_the_openai_client(served, name, chat):
    """Each parameter sent as the official client sends it (a keyword, or extra_body where its
    signature lacks one): served and ignored rows answer, neutral-only rows refuse a non-neutral
    value naming the parameter."""
    kind = compatibility_table()[name][1]
    client = served.client()
    create = client.chat.completions.create if chat else client.completions.create
    request = {"model": MODEL_ID, "max_tokens": 6} | ({"messages": MESSAGES} if chat else {"prompt": PROMPT})
    value = EXAMPLES[name] if name != "logprobs" else (True if chat else 2)
    if name == "top_logprobs":
        request["logprobs"] = True
    if name == "max_completion_tokens":
        request.pop("max_tokens")
    if name == "stream_options":
        request["stream"] = True
    request |= {name: value} if name in inspect.signature(create).parameters else {"extra_body": {name: value}}
    if kind == "neutral only":
        with pytest.raises(openai.BadRequestError) as error:
            create(**request)
        assert error.value.param == name
        return
    response = create(**request)
    if request.get("stream"):
        chunks = list(response)
        assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("stop", "length")
        assert (chunks[-1].usage is not None) == (name == "stream_options")
    else:
        assert response.choices[0].finish_reason in ("stop", "length")
