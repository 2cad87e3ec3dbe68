"""Conversions between the gRPC messages of protos/specserve.proto and the service's types."""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from cluster.engine.request import GenerationOutput
from cluster.engine.spec_engine import StepEvent
from cluster.engine.stats import RequestStats
from cluster.serve.models import ModelNotFound
from cluster.serve.service import InvalidRequest, Overloaded, RequestOptions, SpecService, Unauthorized
from protos import specserve_pb2 as pb
from speculators.logprobs import TokenLogprob


@dataclass
class UndecodableRequest:
    """Handed to a method in place of a request whose bytes do not parse (invalid UTF-8 in a string
    field, a corrupt wire format): the method answers INVALID_ARGUMENT instead of gRPC's UNKNOWN."""

    reason: str


def parse_or_explain(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return UndecodableRequest(str(error))

    return parse


def add_SpecServeServicer_to_server(servicer, server) -> None:  # noqa: N802 (the name gRPC servicer functions have)
    """What protos/specserve_pb2_grpc's function of this name does, except that requests that do not
    parse reach the servicer as UndecodableRequest. Serve's gRPC proxy keeps these deserializers."""
    service = pb.DESCRIPTOR.services_by_name["SpecServe"]
    handlers = {}
    for method in service.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=parse_or_explain(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def checked(message) -> pb.GenerateRequest:
    """The request, or InvalidRequest when its bytes did not parse."""
    if isinstance(message, UndecodableRequest):
        raise InvalidRequest("request", f"is not a valid specserve.GenerateRequest ({message.reason})")
    return message


class WorkerFailed(RuntimeError):
    """A worker failed while decoding the request; the client may retry (UNAVAILABLE)."""


STATUS_OF_ERROR = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    WorkerFailed: grpc.StatusCode.UNAVAILABLE,
}


def status_of(error: Exception) -> grpc.StatusCode:
    return next((code for kind, code in STATUS_OF_ERROR.items() if isinstance(error, kind)), grpc.StatusCode.INTERNAL)


def options_from(message: pb.GenerateRequest) -> RequestOptions:
    """The wire request as RequestOptions; proto3 defaults mean 'not given'."""
    payload: dict = {}
    kind = message.WhichOneof("prompt")
    if kind == "text":
        payload["prompt"] = message.text
    elif kind == "token_ids":
        payload["prompt_token_ids"] = list(message.token_ids.ids)
    elif kind == "chat":
        payload["messages"] = [{"role": m.role, "content": m.content} for m in message.chat.messages]
    sampling = message.sampling
    payload.update(temperature=sampling.temperature, top_k=sampling.top_k, stop=list(sampling.stop))
    for name in ("max_new_tokens", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logprobs"):
        if sampling.HasField(name):
            payload[name] = getattr(sampling, name)
    if message.HasField("structured_output"):
        payload["structured_output"] = {"kind": message.structured_output.kind,
                                        "value": message.structured_output.value or None}
    if message.HasField("cache_salt"):
        payload["cache_salt"] = message.cache_salt
    speculation = message.speculation
    spec: dict = {"method": speculation.method or "default"}
    if speculation.lookahead:
        spec["lookahead"] = speculation.lookahead
    for name in ("max_speculative_tokens", "num_speculative_tokens", "confidence_threshold"):
        if speculation.HasField(name):  # the old lookahead name is an alias; the new one wins
            spec[name.replace("max_", "num_")] = getattr(speculation, name)
    payload["speculation"] = spec
    return SpecService.parse_options(payload)


def stats_message(stats: RequestStats, new_tokens: int) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        drafted=stats.drafted, accepted=stats.accepted, mean_accepted_tokens=stats.mean_accepted_tokens(new_tokens),
        target_forwards=stats.target_forwards, time_to_first_token_s=stats.time_to_first_token or 0.0,
        grammar_pruned=stats.grammar_pruned, cached_prompt_tokens=stats.cached_prompt_tokens,
        preemptions=stats.preemptions,
    )


def logprob_messages(entries: list[TokenLogprob] | None, service: SpecService) -> list[pb.TokenLogprob]:
    if not entries:
        return []
    text = service.token_strings.text
    return [pb.TokenLogprob(token_id=e.token, token=text(e.token), logprob=e.logprob,
                            top=[pb.TopLogprob(token_id=t, token=text(t), logprob=lp) for t, lp in e.top])
            for e in entries]


def response_message(output: GenerationOutput, prompt_tokens: int, service: SpecService) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        text=output.text, token_ids=output.token_ids, finish_reason=output.finish_reason,
        stats=stats_message(output.stats, len(output.token_ids)), prompt_tokens=prompt_tokens,
        finish_detail=output.finish_detail or "", logprobs=logprob_messages(output.logprobs, service),
    )


def chunk_message(event: StepEvent, service: SpecService) -> pb.GenerateChunk:
    """One step's tokens, text and logprobs; the last chunk also says how the output ended."""
    chunk = pb.GenerateChunk(token_ids=event.new_token_ids, text=event.text,
                             logprobs=logprob_messages(event.logprobs, service))
    finished = event.finished
    if finished:
        chunk.finish_reason, chunk.finish_detail = finished.finish_reason, finished.finish_detail or ""
        chunk.stats.CopyFrom(stats_message(finished.stats, len(finished.token_ids)))
    return chunk


def metadata_value(grpc_context, key: str) -> str | None:
    if grpc_context is None:
        return None
    return next((value for name, value in grpc_context.invocation_metadata() if name == key), None)
