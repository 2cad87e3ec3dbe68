"""The gRPC wire layer without a server: message -> options, errors -> status codes."""
import grpc
import pytest

from cluster.serve.grpc_api import WorkerFailed, metadata_value, options_from, status_of
from cluster.serve.models import ModelNotFound
from cluster.serve.service import InvalidRequest, Overloaded, Unauthorized
from protos import specserve_pb2 as pb


def test_unset_proto3_fields_take_the_service_defaults():
    options = options_from(pb.GenerateRequest(text="hi"))
    assert options.prompt == "hi" and options.max_new_tokens is None and options.top_p == 1.0
    assert options.seed is None and options.speculation.method == "default"


def test_every_field_reaches_the_options():
    message = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
        sampling=pb.Sampling(max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop=["x"]),
        speculation=pb.Speculation(method="off", lookahead="fixed", max_speculative_tokens=4, confidence_threshold=0.3),
    )
    options = options_from(message)
    assert options.messages == [{"role": "user", "content": "hi"}]
    assert (options.max_new_tokens, options.temperature, options.top_k, options.seed, options.stop) == (7, 0.5, 3, 11, ["x"])
    assert options.top_p == pytest.approx(0.9)
    assert options.speculation.model_dump() == pytest.approx(
        {"method": "off", "lookahead": "fixed", "num_speculative_tokens": 4, "confidence_threshold": 0.3})
    assert options_from(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]))).prompt_token_ids == [1, 2]


def test_the_api_features_reach_the_options():
    message = pb.GenerateRequest(
        text="hi", model="m", structured_output=pb.StructuredOutput(kind="regex", value="[ab]+"),
        sampling=pb.Sampling(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.25, logprobs=3))
    options = options_from(message)
    assert (options.presence_penalty, options.frequency_penalty, options.repetition_penalty, options.logprobs) == \
        (0.5, -1, 1.25, 3)
    assert (options.structured_output.kind, options.structured_output.value) == ("regex", "[ab]+")
    plain = options_from(pb.GenerateRequest(text="hi"))
    assert (plain.logprobs, plain.structured_output, plain.repetition_penalty) == (None, None, 1.0)


def test_an_unknown_lookahead_names_its_field():
    with pytest.raises(InvalidRequest) as caught:
        options_from(pb.GenerateRequest(text="hi", speculation=pb.Speculation(lookahead="sideways")))
    assert caught.value.field == "speculation.lookahead"


@pytest.mark.parametrize("error,code", [
    (InvalidRequest("prompt", "empty"), grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unauthorized("no key"), grpc.StatusCode.UNAUTHENTICATED),
    (WorkerFailed("retry"), grpc.StatusCode.UNAVAILABLE),
    (ModelNotFound("gpt-4", ["m"]), grpc.StatusCode.NOT_FOUND),
    (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
])
def test_errors_map_to_status_codes(error, code):
    assert status_of(error) == code


def test_authorization_metadata_is_read():
    class Context:
        def invocation_metadata(self):
            return [("application", "specserve"), ("authorization", "Bearer k")]

    assert metadata_value(Context(), "authorization") == "Bearer k"
    assert metadata_value(None, "authorization") is None


def test_bytes_that_do_not_parse_become_invalid_argument_naming_the_request():
    from cluster.serve.grpc_api import UndecodableRequest, checked, parse_or_explain

    good = pb.GenerateRequest(text="AB").SerializeToString()
    parse = parse_or_explain(pb.GenerateRequest)
    assert checked(parse(good)).text == "AB"
    for bad in (good.replace(b"AB", b"\xff\xfe"), b"\xff\xff\xff"):
        message = parse(bad)
        assert isinstance(message, UndecodableRequest)
        with pytest.raises(InvalidRequest) as refused:
            checked(message)
        assert refused.value.field == "request" and status_of(refused.value) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("error,hint", [(Overloaded("full"), True), (WorkerFailed("retry"), True),
                                        (InvalidRequest("prompt", "empty"), False)])
def test_retryable_grpc_errors_carry_a_retry_hint(error, hint):
    from cluster.serve.app import SpecServer

    class Context:
        trailing = None

        def set_code(self, code):
            self.code = code

        def set_details(self, details):
            self.details = details

        def set_trailing_metadata(self, metadata):
            self.trailing = metadata

    context = Context()
    SpecServer.func_or_class._fail(context, error)
    assert context.code == status_of(error) and context.details == str(error)
    assert (context.trailing == [("retry-after", "1")]) == hint
