"""Suffix decoding's cache scope as the front ends set it (limits.cache_sharing, limits.tenant_from):
a tenant is told apart by a hash of its API key unless the deployment trusts a header or the OpenAI
`user` field, and no client can name its scope itself."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from cluster.engine.config import EngineConfig
from cluster.serve.app import SpecServer
from cluster.serve.models import ServedModels
from cluster.serve.openai_schema import parse_call
from cluster.serve.requests import TENANT_HEADER, RequestBuilder, RequestOptions
from cluster.serve.service import InvalidRequest, ServiceLimits, SpecService
from protos import specserve_pb2 as pb
from speculators.lookahead import LookaheadConfig


class Tokenizer:
    """Token-id prompts only."""

    def __len__(self):
        return 1000


class Engine:
    def validate(self, request):
        pass


def service(**limits) -> SpecService:
    return SpecService([SimpleNamespace(engine=Engine())], Tokenizer(), "m", "suffix", LookaheadConfig(),
                       ServiceLimits(**limits))


def scope(served: SpecService, headers: dict[str, str] | None = None, **body) -> str | None:
    raw = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, **body}).encode()
    return parse_call(raw, ServedModels([served]), False, "id", headers).samples.requests[0].cache_scope


def test_tenants_are_told_apart_by_a_hash_of_their_api_key():
    served = service()  # the default: cache_sharing tenant, tenant_from api_key
    a = scope(served, {"authorization": "Bearer key-a"})
    assert a == scope(served, {"authorization": "Bearer key-a"}) != scope(served, {"authorization": "Bearer key-b"})
    assert a.startswith("tenant:api_key:") and "key-a" not in a
    # the header and the user field are the client's to choose: not read unless the deployment says so
    assert scope(served, {"authorization": "Bearer key-a", TENANT_HEADER: "someone"}, user="else") == a
    assert scope(served) is None and scope(served, {TENANT_HEADER: "someone"}, user="else") is None  # shares nothing


def test_a_client_cannot_name_its_scope_in_the_body():
    with pytest.raises(InvalidRequest) as refused:
        scope(service(cache_sharing="global"), tenant="tenant:api_key:0123")
    assert refused.value.field == "tenant"


def test_global_sharing_shares_everything_and_request_sharing_nothing():
    key = {"authorization": "Bearer key-a"}
    assert scope(service(cache_sharing="global"), key) == "" == scope(service(cache_sharing="global"))
    assert scope(service(cache_sharing="request"), key) is None


def test_a_trusted_header_or_user_field_names_the_tenant():
    by_header, by_user = service(tenant_from="header"), service(tenant_from="user")
    team = scope(by_header, {TENANT_HEADER: "team-1", "authorization": "Bearer k"})
    assert team.startswith("tenant:header:") and team != scope(by_header, {TENANT_HEADER: "team-2"})
    assert team == scope(by_header, {TENANT_HEADER: "team-1", "authorization": "Bearer other"})
    assert scope(by_user, user="alice").startswith("tenant:user:") and scope(by_user, user="alice") != scope(by_user, user="bob")
    assert scope(by_user, {TENANT_HEADER: "team-1"}) is None
    with pytest.raises(InvalidRequest) as refused:
        scope(by_user, user=5)
    assert refused.value.field == "user"


def test_in_process_runs_share_one_scope():
    builder = RequestBuilder.in_process(Engine(), Tokenizer(), EngineConfig(max_len=64))
    assert builder.build_request(RequestOptions(prompt_token_ids=[1, 2])).cache_scope == ""


class GrpcContext:
    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


def test_grpc_requests_get_the_scope_of_the_same_tenant_over_http():
    servable = next(cls for cls in SpecServer.func_or_class.__mro__ if "_request" in vars(cls))  # not Serve's wrapper
    server = object.__new__(servable)  # no __init__: the replica's models only
    message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.Sampling(max_new_tokens=4))
    for limits, metadata, headers in [
        ({}, [("authorization", "key-a")], {"authorization": "Bearer key-a"}),
        ({"tenant_from": "header"}, [(TENANT_HEADER, "team-1")], {TENANT_HEADER: "team-1"}),
    ]:
        served = service(**limits)
        server.models = ServedModels([served])
        _, request = asyncio.run(server._request(message, GrpcContext(metadata)))
        assert request.cache_scope == scope(served, headers) and request.cache_scope
