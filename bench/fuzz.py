"""Property-based fuzz of both request schemas (OpenAI-style JSON bodies and gRPC messages).

The property: every body or message either becomes a request the engine serves to a normal end
('stop' or 'length'), or is refused with InvalidRequest naming a field; never another exception, a
request outside the limits, or a failed worker. The test suite runs a few hundred cases
(tests/cluster/serve/test_fuzz.py); `specserve fuzz --examples N` runs as many as asked.

Inputs mix plausible values (near every limit) with arbitrary JSON: wrong types, NaN and
infinities, huge integers, lone surrogates, unknown fields, bytes that are not UTF-8.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace

from cluster.engine.request import GenerationRequest
from cluster.engine.spec_engine import SpecEngine
from cluster.serve import grpc_api
from cluster.serve.models import ModelNotFound, ServedModels
from cluster.serve.openai_schema import parse_call
from cluster.serve.service import InvalidRequest, ServiceLimits, SpecService
from protos import specserve_pb2 as pb

FUZZ_LIMITS = ServiceLimits(max_prompt_tokens=48, max_new_tokens=8, max_stop_strings=4, max_stop_string_chars=16)
"""Small limits, so that accepted requests decode in milliseconds on a tiny model."""
FUZZ_MAX_LEN = 64


@dataclass
class FuzzTarget:
    """A service over a tiny random model with the default model's tokenizer, and its engine."""

    service: SpecService
    engine: SpecEngine


def build_target(tokenizer) -> FuzzTarget:
    import torch
    from transformers import LlamaConfig

    from actors.model.config import DecoderConfig
    from actors.model.llama import LlamaDecoder
    from cluster.engine.build import local_engine
    from cluster.engine.config import SchedulerConfig
    from speculators.lookahead import LookaheadConfig
    from speculators.proposers.prompt_lookup import PromptLookupProposer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=FUZZ_MAX_LEN * 2)
    model = LlamaDecoder(DecoderConfig.from_hf(config)).eval()
    engine = local_engine(model, tokenizer, PromptLookupProposer(), SchedulerConfig(max_len=FUZZ_MAX_LEN))
    service = SpecService([SimpleNamespace(engine=engine)], tokenizer, "tiny", "pld", LookaheadConfig(), FUZZ_LIMITS)
    return FuzzTarget(service, engine)


# ---- strategies ----------------------------------------------------------------------------------

SURROGATES = ["\ud800", "a\udfff b"]
RESPONSE_FORMATS = [{"type": "text"}, {"type": "json_object"}, {"type": "yaml"}, {"type": "json_schema"},
                    {"type": "json_schema", "json_schema": {"name": "digit", "schema": {"enum": [1, 2, 3]}}},
                    {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}]


def _strategies():
    from hypothesis import strategies as st

    return st


def json_values():
    """Any JSON value, NaN and infinities included (Python's json module reads and writes them)."""
    st = _strategies()
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                        st.text(max_size=20), st.sampled_from(SURROGATES))
    return st.recursive(scalars,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                        max_leaves=8)


def _numbers(low: float, high: float):
    st = _strategies()
    return st.floats(low, high) | st.sampled_from([0.0, 1e-300, 1e300, float("nan"), float("inf"), -float("inf")])


def _text(max_size: int):
    st = _strategies()
    return st.text(max_size=max_size) | st.sampled_from(SURROGATES)


def http_bodies(chat: bool):
    """JSON bodies of /v1/completions (chat False) or /v1/chat/completions, as bytes: mostly
    plausible bodies (values around every limit), some with one field replaced by arbitrary JSON or an
    unknown field added, and some that are no JSON object at all."""
    st = _strategies()
    messages = st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant", "developer", "robot"]),
        "content": _text(40) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text(20)}), max_size=2),
    }), min_size=1, max_size=3)
    speculation = st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(["default", "off", "none", "pld", "draft"]),
        "lookahead": st.sampled_from(["fixed", "heuristic", "confidence", "sideways"]),
        "num_speculative_tokens": st.integers(-1, 65), "max_speculative_tokens": st.integers(0, 65),
        "confidence_threshold": _numbers(-0.1, 1.1),
    })
    fields = {
        "model": st.just("tiny"),
        "max_tokens": st.integers(-1, 9), "max_completion_tokens": st.integers(0, 9),
        "temperature": _numbers(0, 2), "top_p": _numbers(-0.1, 1.1), "top_k": st.integers(-2, 60_000),
        "seed": st.integers(-2**64, 2**64),
        "stop": _text(18) | st.lists(_text(18), max_size=5),
        "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "speculation": speculation,
        "n": st.sampled_from([1, 2]), "logprobs": st.sampled_from([False, True, 0, 3]), "user": st.text(max_size=8),
        "top_logprobs": st.integers(-1, 21), "best_of": st.integers(0, 3),
        "presence_penalty": _numbers(-3, 3), "frequency_penalty": _numbers(-3, 3), "repetition_penalty": _numbers(-0.5, 3),
        "response_format": st.sampled_from(RESPONSE_FORMATS),
    }
    if chat:
        required = {"messages": messages}
    else:
        required = {"prompt": _text(120) | st.lists(st.integers(-1, 50_000), min_size=1, max_size=50)
                    | st.lists(_text(30), min_size=1, max_size=2)}
    plausible = st.fixed_dictionaries(required, optional=fields)
    names = sorted({*required, *fields, "unknown_field", ""})
    mutated = st.builds(lambda body, name, value: body | {name: value}, plausible, st.sampled_from(names), json_values())
    objects = st.one_of(plausible, plausible, plausible, mutated).map(lambda body: json.dumps(body).encode())
    return objects | json_values().map(lambda value: json.dumps(value).encode()) | st.binary(max_size=40)


def grpc_messages():
    """GenerateRequest messages as bytes on the wire, and some bytes that are no such message."""
    st = _strategies()
    uint32, floats = st.integers(0, 2**32 - 1), st.floats(width=32)
    sampling = st.fixed_dictionaries({}, optional={
        "max_new_tokens": st.integers(0, 9) | uint32, "temperature": _numbers(0, 2).map(_float32) | floats,
        "top_k": st.integers(0, 60_000) | uint32, "top_p": _numbers(-0.1, 1.1).map(_float32) | floats,
        "seed": st.integers(0, 2**64 - 1), "stop": st.lists(st.text(max_size=24), max_size=6),
        "presence_penalty": _numbers(-3, 3).map(_float32), "repetition_penalty": _numbers(-0.5, 3).map(_float32),
        "logprobs": st.integers(0, 25),
    }).map(lambda fields: pb.Sampling(**fields))
    speculation = st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(["", "default", "off", "pld", "draft"]),
        "lookahead": st.sampled_from(["", "fixed", "heuristic", "confidence", "sideways"]),
        "num_speculative_tokens": st.integers(0, 65) | uint32, "max_speculative_tokens": st.integers(0, 65),
        "confidence_threshold": _numbers(-0.1, 1.1).map(_float32),
    }).map(lambda fields: pb.Speculation(**fields))
    chat = st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant", "robot", ""]),
                              content=st.text(max_size=40)), max_size=3)
    prompts = st.one_of(
        st.none(),
        st.text(max_size=120).map(lambda text: {"text": text}),
        st.lists(st.integers(-1, 50_000), max_size=50).map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
        st.lists(st.integers(-2**31, 2**31 - 1), max_size=3).map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
        chat.map(lambda messages: {"chat": pb.ChatMessages(messages=messages)}),
    )
    messages = st.builds(lambda prompt, sampling, speculation: pb.GenerateRequest(
        **(prompt or {}), sampling=sampling, speculation=speculation), prompts, sampling, speculation)
    return messages.map(lambda message: message.SerializeToString()) | st.binary(max_size=60)


def _float32(value: float) -> float:
    """A float the proto's 32-bit field can hold (huge values become infinities, as on the wire)."""
    import numpy

    with numpy.errstate(over="ignore"):
        return float(numpy.float32(value))


# ---- the property --------------------------------------------------------------------------------


def check_request(target: FuzzTarget, request: GenerationRequest) -> None:
    """An accepted request is within every limit and decodes to a normal end."""
    limits, sampling = target.service.limits, request.sampling
    assert 1 <= request.max_new_tokens <= limits.max_new_tokens
    assert 1 <= len(request.prompt_ids) <= limits.max_prompt_tokens
    assert all(0 <= token < target.engine.vocab_size for token in request.prompt_ids)
    assert math.isfinite(sampling.temperature) and math.isfinite(sampling.top_p)
    assert len(request.stop) <= limits.max_stop_strings
    assert all(0 < len(stop) <= limits.max_stop_string_chars for stop in request.stop)
    output = target.engine.generate([request])[0]
    assert output.finish_reason in ("stop", "length"), output.error
    assert not target.engine.has_work


def check_refusal(error: InvalidRequest) -> None:
    assert error.field and str(error).startswith(f"{error.field}: ")


def check_http_body(target: FuzzTarget, body: bytes, chat: bool, request_id: str = "fuzz") -> None:
    try:
        call = parse_call(body, ServedModels([target.service]), chat, request_id)
    except InvalidRequest as error:
        check_refusal(error)
        return
    except ModelNotFound:  # a refusal naming the model, by construction
        return
    for request in call.samples.requests:
        check_request(target, request)


def check_grpc_message(target: FuzzTarget, data: bytes, request_id: str = "fuzz") -> None:
    """The server's path: parse the bytes (grpc_api's deserializer), then the message's fields."""
    message = grpc_api.parse_or_explain(pb.GenerateRequest)(data)
    try:
        request = target.service.build_request(grpc_api.options_from(grpc_api.checked(message)), request_id)
    except InvalidRequest as error:
        check_refusal(error)
        return
    check_request(target, request)


def fuzz(target: FuzzTarget, examples: int, seed: int | None = None) -> None:
    """Run the property over both schemas, `examples` cases each; raises on the first failure."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis import strategies as st

    config = settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))

    @config
    @given(case=st.tuples(http_bodies(chat=False), st.just(False)) | st.tuples(http_bodies(chat=True), st.just(True)))
    def http(case):
        check_http_body(target, *case)

    @config
    @given(message=grpc_messages())
    def grpc(message):
        check_grpc_message(target, message)

    for test in (http, grpc):
        (test if seed is None else fixed_seed(seed)(test))()


# ---- command ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=int, default=5000, help="cases per schema (HTTP and gRPC)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed, to repeat a run")


def run(args: argparse.Namespace) -> int:
    from actors.model.loader import DEFAULT_MODEL, load_tokenizer

    target = build_target(load_tokenizer(DEFAULT_MODEL))
    began = time.perf_counter()
    fuzz(target, args.examples, args.seed)
    print(f"fuzz: {args.examples} HTTP bodies and {args.examples} gRPC messages, every one served or refused "
          f"naming its field, in {time.perf_counter() - began:.0f} s")
    return 0
