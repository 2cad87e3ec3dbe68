"""The cache scope (prefix cache and suffix index) as the front ends set it (limits.cache_sharing,
limits.tenant_from): a tenant is the one its API key names (a deployment without keys is one tenant)
unless the deployment trusts a header or the OpenAI `user` field, and no client names its scope itself."""
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
    """The cache scope of a completion sent with these headers, as the HTTP route builds it."""
    raw = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, **body}).encode()
    key_tenant = served.authorize((headers or {}).get("authorization"))
    return parse_call(raw, ServedModels([served]), False, "id", headers, key_tenant).samples.requests[0].cache_scope


def test_a_deployment_without_keys_is_one_tenant():
    """`make serve` has no key: curl, GuideLLM (no Authorization) and the openai client (any token)
    share one scope, so they hit the prefix cache; the token is no credential there."""
    served = service()  # the default: cache_sharing tenant, tenant_from api_key
    shared = scope(served)
    assert shared and shared.startswith("tenant:api_key:")
    assert scope(served, {"authorization": "Bearer EMPTY"}) == shared == scope(served, {"authorization": "Bearer sk-x"})
    # the header and the user field are the client's to choose: not read unless the deployment says so
    assert scope(served, {TENANT_HEADER: "someone"}, user="else") == shared


def test_the_holders_of_the_one_key_are_one_tenant():
    served = service(api_key="key-a")
    keyed = scope(served, {"authorization": "Bearer key-a"})
    assert keyed.startswith("tenant:api_key:") and "key-a" not in keyed and keyed == scope(served, {"authorization": "key-a"})
    assert keyed != scope(service(), {"authorization": "Bearer key-a"})  # not the keyless deployment's tenant


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
        ({"api_key": "key-a"}, [("authorization", "key-a")], {"authorization": "Bearer key-a"}),
        ({"tenant_from": "header"}, [(TENANT_HEADER, "team-1")], {TENANT_HEADER: "team-1"}),
    ]:
        served = service(**limits)
        server.models = ServedModels([served])
        _, request = asyncio.run(server._request(message, GrpcContext(metadata)))
        assert request.cache_scope == scope(served, headers) and request.cache_scope


def test_a_cache_salt_narrows_every_sharing_but_none():
    salted = scope(service(cache_sharing="global"), cache_salt="my salt")
    assert salted != "" and salted == scope(service(cache_sharing="global"), cache_salt="my salt")
    assert "my salt" not in salted  # hashed
    assert scope(service(), cache_salt="s") not in (scope(service()), salted)
    assert scope(service(cache_sharing="request"), cache_salt="s") is None
