"""Tenants kept apart where it shows: a request's cached prompt tokens (HTTP
usage.prompt_tokens_details.cached_tokens, gRPC cached_prompt_tokens) come only from requests of its
own tenant (the one its API key names, limits.api_keys_file) giving the same `cache_salt`; a
deployment without keys is one tenant; suffix decoding drafts only from its own tenant's earlier
outputs. A tiny model on one engine loop, behind two front ends: one with a keys file, one with no
key; and a suffix-decoding engine loop behind the keys file (uvicorn for HTTP, SpecServer's gRPC
methods called without Ray)."""
from __future__ import annotations

import asyncio
import http.client
import json
from dataclasses import dataclass

import grpc
import pytest
import torch
from fastapi import FastAPI

from actors.model.loader import load_tokenizer
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.loop import EngineLoop
from cluster.serve.app import SpecServer
from cluster.serve.models import ServedModels
from cluster.serve.openai_api import build_openai_router
from cluster.serve.service import ServiceLimits, SpecService
from protos import specserve_pb2 as pb
from speculators.lookahead import LookaheadConfig
from speculators.proposers.prompt_lookup import PromptLookupProposer
from speculators.proposers.suffix import SuffixProposer
from tests.cluster.serve.grpc_context import GrpcContext
from tests.cluster.serve.uvicorn_server import uvicorn_server
from tests.conftest import tiny_pair

pytestmark = pytest.mark.default_model

MODEL_ID = "tiny-llama"
ALICE, ALICE_2, BOB = "key-alice", "key-alice-second", "key-bob"
SUFFIX_OUTPUT_TOKENS = 24


def prompt(topic: str) -> str:
    """A prompt of several 16-token blocks, its own per test (the prefix cache outlives a test)."""
    return f"Notes on {topic}. " + " ".join(f"{topic} fact number {i} is worth keeping." for i in range(8))


@dataclass
class Served:
    keyed: SpecService
    keyed_port: int
    open_port: int
    suffix: SpecService
    """Suffix decoding, behind the same keys file (a loop of its own)."""
    suffix_port: int

    def cached(self, text: str, key: str | None = None, port: int | None = None, **body) -> int:
        """cached_tokens of a completion of `text` sent with `key` (None: no Authorization)."""
        status, answer = self.post(text, key, port, **body)
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    def post(self, text: str, key: str | None, port: int | None = None, **body) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", port or self.keyed_port, timeout=60)
        try:
            headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
            connection.request("POST", "/v1/completions", json.dumps(
                {"model": MODEL_ID, "prompt": text, "max_tokens": 2, "temperature": 0} | body), headers)
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    tokenizer = load_tokenizer(default_model_path)
    model, _ = tiny_pair(dtype=torch.float64, vocab_size=len(tokenizer))
    loop = EngineLoop(local_engine(model, tokenizer, PromptLookupProposer(), SchedulerConfig(max_len=512)), "tenants")
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(f"{ALICE}: alice\n{ALICE_2}: alice\n{BOB}: bob\n")
    keyed = SpecService([loop], tokenizer, MODEL_ID, "pld", LookaheadConfig(), ServiceLimits(api_keys_file=str(keys)))
    keyless = SpecService([loop], tokenizer, MODEL_ID, "pld", LookaheadConfig(), ServiceLimits())
    suffix_model, _ = tiny_pair(dtype=torch.float64, vocab_size=len(tokenizer))
    suffix_loop = EngineLoop(local_engine(suffix_model, tokenizer, SuffixProposer(), SchedulerConfig(max_len=512)),
                             "tenants-suffix")
    suffix = SpecService([suffix_loop], tokenizer, MODEL_ID, "suffix", LookaheadConfig(),
                         ServiceLimits(api_keys_file=str(keys)))
    apps = []
    for service in (keyed, keyless, suffix):
        apps.append(FastAPI())
        apps[-1].include_router(build_openai_router(lambda service=service: ServedModels([service])))
    with uvicorn_server(apps[0], "tenants-keyed") as keyed_port, uvicorn_server(apps[1], "tenants-open") as open_port, \
            uvicorn_server(apps[2], "tenants-suffix") as suffix_port:
        yield Served(keyed=keyed, keyed_port=keyed_port, open_port=open_port, suffix=suffix, suffix_port=suffix_port)
    loop.stop()
    suffix_loop.stop()


def test_another_key_cannot_find_a_tenants_prompt_in_the_cache(served):
    text = prompt("otters")
    assert served.cached(text, ALICE) == 0
    assert served.cached(text, BOB) == 0  # bob's own first request: nothing of alice's
    assert served.cached(text, ALICE) > 0 and served.cached(text, ALICE_2) > 0  # alice's other key: her tenant
    assert served.cached(text, BOB) > 0  # and bob's second finds bob's first


def test_a_cache_salt_shares_only_with_the_same_salt_of_the_same_tenant(served):
    text = prompt("herons")
    assert served.cached(text, ALICE, cache_salt="s1") == 0
    assert served.cached(text, ALICE, cache_salt="s1") > 0
    assert served.cached(text, ALICE, cache_salt="s2") == 0
    assert served.cached(text, ALICE) == 0  # unsalted is a scope of its own
    assert served.cached(text, BOB, cache_salt="s1") == 0  # a salt is no way into another tenant


def test_a_deployment_without_keys_shares_its_prefix_cache(served):
    text = prompt("lichens")
    assert served.cached(text, port=served.open_port) == 0
    assert served.cached(text, port=served.open_port) > 0  # no Authorization header, as curl and GuideLLM send
    assert served.cached(text, "EMPTY", port=served.open_port) > 0  # the openai client's placeholder token
    assert served.cached(text, ALICE) == 0  # not a keyed deployment's tenant


@pytest.mark.parametrize("salt, message", [(5, "valid string"), ("", "non-empty"), (["a"], "valid string")])
def test_a_bad_cache_salt_is_refused_naming_it(served, salt, message):
    status, answer = served.post(prompt("moss"), ALICE, cache_salt=salt)
    assert status == 400 and answer["error"]["param"] == "cache_salt" and message in answer["error"]["message"]


def grpc_server(service: SpecService):
    servable = next(cls for cls in SpecServer.func_or_class.__mro__ if "_request" in vars(cls))  # not Serve's wrapper
    server = object.__new__(servable)  # no __init__: the replica's models only
    server.models = ServedModels([service])
    return server


def test_grpc_tenants_and_salts_are_kept_apart_too(served):
    server, text = grpc_server(served.keyed), prompt("gannets")

    def cached(key: str, **fields) -> int:
        context = GrpcContext(key)
        message = pb.GenerateRequest(text=text, sampling=pb.Sampling(max_new_tokens=2), **fields)
        answer = asyncio.run(server.Generate(message, context))
        assert context.code is None, context.details
        return answer.stats.cached_prompt_tokens

    assert cached(ALICE) == 0 and cached(BOB) == 0 and cached(ALICE) > 0
    assert cached(ALICE, cache_salt="g") == 0 and cached(ALICE, cache_salt="g") > 0 and cached(BOB, cache_salt="g") == 0
    assert served.cached(text, ALICE) > 0 == served.cached(text, ALICE, cache_salt="h")  # one scope over both protocols
    context = GrpcContext(ALICE)
    asyncio.run(server.Generate(pb.GenerateRequest(text=text, cache_salt=""), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith("cache_salt:")


def test_another_key_gets_no_draft_from_a_tenants_output(served):
    """Suffix decoding learns each output under its request's scope: bob, sending alice's prompt and the
    first half of her output, drafts nothing her output taught the index (0 accepted, HTTP
    `speculation.accepted`; gRPC `stats.accepted` with a salt, a scope of his own not yet taught by his
    first answer), while alice, sending the same, drafts the second half from it."""
    server = grpc_server(served.suffix)
    ids = served.suffix.tokenizer.encode(prompt("puffins"))

    def generate(key: str, prompt_ids: list[int], new_tokens: int, **fields) -> pb.GenerateResponse:
        context = GrpcContext(key)
        answer = asyncio.run(server.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt_ids), sampling=pb.Sampling(max_new_tokens=new_tokens), **fields), context))
        assert context.code is None, context.details
        return answer

    output = list(generate(ALICE, ids, SUFFIX_OUTPUT_TOKENS).token_ids)  # token ids come back by gRPC
    assert len(output) == SUFFIX_OUTPUT_TOKENS  # no early end: its second half is there to be drafted
    half = SUFFIX_OUTPUT_TOKENS // 2
    context, rest = ids + output[:half], SUFFIX_OUTPUT_TOKENS - half
    status, answer = served.post(None, BOB, served.suffix_port, prompt=context, max_tokens=rest)
    assert status == 200 and answer["speculation"]["accepted"] == 0, answer
    bob = generate(BOB, context, rest, cache_salt="bob")
    assert list(bob.token_ids) == output[half:]  # the same text: drafts from alice's output would be accepted
    assert bob.stats.accepted == 0, bob.stats
    alice = generate(ALICE_2, context, rest)  # her other key: her tenant
    assert list(alice.token_ids) == output[half:] and alice.stats.accepted > 0, alice.stats
    assert answer["choices"][0]["text"] == alice.text
