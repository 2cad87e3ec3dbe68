"""TLS for the gRPC API: a forwarder that terminates TLS and passes each call to Serve's gRPC proxy.

Ray Serve's gRPC proxy (2.60) listens in plaintext only, while its HTTP proxy takes TLS itself
(`http_options.ssl_certfile` / `ssl_keyfile`). Run this next to the proxy (`specserve grpc-tls`) and
expose only its port: calls arrive encrypted, leave for 127.0.0.1 in plaintext, and keep their
metadata (the API key), deadline and cancellation. Messages are forwarded as bytes, never parsed.
"""
from __future__ import annotations

import argparse
from concurrent import futures
from pathlib import Path

import grpc

from protos import specserve_pb2

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
FORWARDED_METADATA_PREFIXES = (":", "grpc-", "user-agent")
"""Transport metadata that the upstream channel sets itself."""


def forwarded_methods() -> dict[str, bool]:
    """Method path -> whether the server streams its answer: specserve.SpecServe and the health check."""
    service = specserve_pb2.DESCRIPTOR.services_by_name["SpecServe"]
    methods = {f"/{service.full_name}/{m.name}": m.server_streaming for m in service.methods}
    return methods | {HEALTH_CHECK: False}


class _Forwarder(grpc.GenericRpcHandler):
    def __init__(self, upstream: grpc.Channel):
        self.upstream, self.methods = upstream, forwarded_methods()

    def service(self, details: grpc.HandlerCallDetails):
        streaming = self.methods.get(details.method)
        if streaming is None:
            return None  # UNIMPLEMENTED, as the proxy would answer
        if streaming:
            call = self.upstream.unary_stream(details.method)
            return grpc.unary_stream_rpc_method_handler(lambda request, context: self._stream(call, request, context))
        call = self.upstream.unary_unary(details.method)
        return grpc.unary_unary_rpc_method_handler(lambda request, context: self._unary(call, request, context))

    @staticmethod
    def _options(context: grpc.ServicerContext) -> dict:
        metadata = [(k, v) for k, v in context.invocation_metadata() if not k.startswith(FORWARDED_METADATA_PREFIXES)]
        return {"metadata": metadata, "timeout": context.time_remaining()}

    def _unary(self, call, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return call(request, **self._options(context))
        except grpc.RpcError as error:
            context.abort(error.code(), error.details())

    def _stream(self, call, request: bytes, context: grpc.ServicerContext):
        answers = call(request, **self._options(context))
        context.add_callback(answers.cancel)  # a client that leaves frees its slot upstream
        try:
            yield from answers
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED or context.is_active():
                context.abort(error.code(), error.details())


def serve_tls(certfile: Path, keyfile: Path, port: int, upstream: str, host: str = "0.0.0.0",
              workers: int = 64) -> grpc.Server:
    """Start the forwarder; `workers` bounds the calls in flight (streams hold a thread each)."""
    credentials = grpc.ssl_server_credentials([(keyfile.read_bytes(), certfile.read_bytes())])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc-tls"))
    server.add_generic_rpc_handlers([_Forwarder(grpc.insecure_channel(upstream))])
    server.add_secure_port(f"{host}:{port}", credentials)
    server.start()
    return server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--certfile", type=Path, required=True, help="PEM certificate chain of this server")
    parser.add_argument("--keyfile", type=Path, required=True, help="PEM private key")
    parser.add_argument("--port", type=int, default=9443, help="TLS port to listen on")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--upstream", default="127.0.0.1:9000", help="Serve's plaintext gRPC proxy")


def run(args: argparse.Namespace) -> int:
    server = serve_tls(args.certfile, args.keyfile, args.port, args.upstream, args.host)
    print(f"gRPC over TLS on {args.host}:{args.port} -> {args.upstream}", flush=True)
    server.wait_for_termination()
    return 0
