"""How the soak test judges each answer: right, wrong, lost, or an error of some kind."""
from bench.soak import Outcome, Prompt, summarize

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
