"""Both request schemas under a property-based fuzz (bench/fuzz.py): every input is served to a normal
end or refused naming a field. `specserve fuzz --examples N` runs the same property for longer."""
import pytest

from actors.model.loader import load_tokenizer
from bench.fuzz import build_target, fuzz
from cluster.serve.models import ServedModels
from cluster.serve.openai_schema import parse_call
from cluster.serve.service import InvalidRequest
from protos import specserve_pb2 as pb

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def target(default_model_path):
    return build_target(load_tokenizer(default_model_path))


def test_both_schemas_under_a_few_hundred_fuzzed_requests(target):
    fuzz(target, examples=200, seed=8)


@pytest.mark.parametrize("body,field", [
    (b'{"max_tokens": 4, "prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"max_tokens": 4, "prompt": "hi", "temperature": 1e-300}', "temperature"),
    (b'{"max_tokens": 4, "prompt": "hi", "top_p": Infinity}', "top_p"),
    (b'{"max_tokens": 4, "prompt": "hi", "speculation": {"confidence_threshold": NaN}}', "speculation.confidence_threshold"),
    (b'{"max_tokens": 4, "prompt": "\\ud800"}', "prompt"),
    (b'{"max_tokens": 4, "prompt": "hi", "stop": "\\udfff"}', "stop[0]"),
    (b'{"prompt": "hi", "max_tokens": 4.5}', "max_tokens"),
    (b'{"max_tokens": 4, "prompt": "hi", "temperature": "0.5"}', "temperature"),
    (b'{"max_tokens": 4, "prompt": "hi", "seed": 100000000000000000000000}', "seed"),
    (b'{"max_tokens": 4, "prompt": "hi", "model": 5}', "model"),
    (b'{"prompt": "hi\xff"}', "body"),
    (b"[" * 100_000, "body"),
    (b'{"max_tokens": 4, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    (b'{"max_tokens": 4, "prompt": "hi", "stop": ["abcdefghijklmnopq"]}', "stop[0]"),
    (b'{"max_tokens": 4, "prompt": "' + b"x" * 10_000 + b'"}', "prompt"),
], ids=lambda value: value[:40].decode(errors="replace") if isinstance(value, bytes) else value)
def test_hostile_bodies_are_refused_naming_the_field(target, body, field):
    with pytest.raises(InvalidRequest) as refused:
        parse_call(body, ServedModels([target.service]), False, "x")
    assert refused.value.field == field


@pytest.mark.parametrize("sampling,field", [
    (pb.Sampling(temperature=float("nan")), "temperature"),
    (pb.Sampling(temperature=float("inf")), "temperature"),
    (pb.Sampling(top_p=float("nan")), "top_p"),
    (pb.Sampling(stop=["s"] * 10_000), "stop"),
])
def test_hostile_grpc_fields_are_refused_naming_the_field(target, sampling, field):
    from cluster.serve.grpc_api import options_from

    with pytest.raises(InvalidRequest) as refused:
        target.service.build_request(options_from(pb.GenerateRequest(text="hi", sampling=sampling)))
    assert refused.value.field == field


def test_a_vanishing_top_p_keeps_the_likeliest_token(target):
    """Found by `specserve fuzz`: top_p 1e-300 rounded to 0 in float32 and dropped every token."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_p": 1e-300, "seed": 1}'
    call = parse_call(body, ServedModels([target.service]), True, "tiny-top-p")
    output = target.engine.generate(call.samples.requests)[0]
    assert output.finish_reason in ("stop", "length") and output.token_ids
