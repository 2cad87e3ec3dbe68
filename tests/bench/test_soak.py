"""How the soak test judges each answer: right, wrong, lost, an error of some kind, or a cache hit
only another tenant explains."""
from bench.soak import Outcome, Prompt, cross_tenant_hits, summarize

PROMPT = Prompt(1, "q", [1, 2], expected_ids=[5, 6, 7], expected_text=" five six seven")


def outcome(protocol: str, **fields) -> Outcome:
    result = Outcome(client=0, protocol=protocol, prompt=0, started=0.0, first_token_s=0.5, tokens=3)
    for name, value in fields.items():
        setattr(result, name, value)
    return result


def test_answers_are_judged_against_plain_greedy_decoding():
    outcomes = [
        outcome("grpc", token_ids=[5, 6, 7], finish_reason="length"),
        outcome("http", text=" five six seven", finish_reason="length", gaps=[0.1, 0.2]),
        outcome("grpc", token_ids=[5, 6, 8], finish_reason="length"),
        outcome("http", text=" five six", finish_reason=None),
        outcome("grpc", error="grpc:UNAVAILABLE"),
        outcome("http", error="http:503"),
        outcome("grpc", error="lost"),
    ]
    summary = summarize(outcomes, [PROMPT], seconds=10.0)
    assert (summary["completed"], summary["mismatched"], summary["lost"]) == (2, 1, 2)
    assert summary["errors_by_kind"] == {"grpc:UNAVAILABLE": 1, "http:503": 1} and summary["errors_all_retryable"]
    assert summary["by_protocol"] == {"grpc": 1, "http": 1} and summary["tokens_per_s"] == 2.1


def test_an_error_a_client_cannot_retry_is_flagged():
    summary = summarize([outcome("grpc", error="grpc:INTERNAL")], [PROMPT], seconds=1.0)
    assert not summary["errors_all_retryable"]


def test_a_literal_api_key_never_reaches_the_report():
    from bench.soak import _without_key

    args = {"cluster": {}, "limits": {"api_key": "k3y", "max_new_tokens": 8}}
    assert "k3y" not in str(_without_key(args)) and _without_key(args)["limits"]["max_new_tokens"] == 8
    assert _without_key({"limits": {"api_key": None}}) == {"limits": {"api_key": None}}


def test_cached_tokens_only_another_tenant_explains_are_flagged():
    """Tenant 0 sent the long prompt first; tenant 1's copy of it may reuse only what tenant 1 sent
    before its first token (the short prompt's two tokens, then the long one), tenant 0's second
    copy all of it."""
    prompts = [Prompt(1, "long", [1, 2, 3, 4, 5], [9], "x"), Prompt(2, "short", [1, 2, 7], [9], "x")]

    def sent(tenant, prompt, started, cached):
        return Outcome(client=tenant, protocol="grpc", prompt=prompt, started=started, first_token_s=0.5,
                       tenant=tenant, cached_tokens=cached)

    outcomes = [sent(0, 0, 0.0, 0), sent(1, 1, 1.0, 0), sent(0, 0, 2.0, 4), sent(1, 0, 3.0, 2), sent(1, 0, 4.0, 4)]
    assert cross_tenant_hits(outcomes, prompts) == []
    outcomes.append(sent(1, 0, 0.2, 4))  # before tenant 1 sent anything: only tenant 0's cache holds it
    assert cross_tenant_hits(outcomes, prompts) == [{"tenant": 1, "question_id": 1, "cached_tokens": 4,
                                                     "own_tenant_prefix": 0}]
    assert summarize(outcomes, prompts, seconds=1.0)["cross_tenant_cache_hits"] == 1


def test_tenants_get_a_key_each_from_a_keys_file(tmp_path):
    import argparse
    import json

    from bench.soak import tenant_keys

    app_args = {"limits": {"api_key": "one", "max_new_tokens": 8}}
    keys = tenant_keys(argparse.Namespace(api_key=None, tenants=2, target=False), app_args, tmp_path)
    named = json.loads((tmp_path / "api-keys.json").read_text())
    assert len(set(keys)) == 2 and sorted(named) == sorted(keys) and len(set(named.values())) == 2
    assert app_args["limits"] == {"api_keys_file": str(tmp_path / "api-keys.json"), "max_new_tokens": 8}
    assert tenant_keys(argparse.Namespace(api_key=["k"], tenants=1, target=True), {}, tmp_path) == ["k"]
