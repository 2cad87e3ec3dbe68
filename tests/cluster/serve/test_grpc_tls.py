"""The gRPC TLS forwarder against a plaintext upstream in this process: calls, streams, metadata, status
codes and cancellation pass through; plaintext clients are refused."""
import time
from concurrent import futures

import grpc
import pytest

from cluster.serve.grpc_tls import serve_tls
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc
from tests.cluster.ray_fixtures import free_port

KEY = "Bearer k"


class Upstream(specserve_pb2_grpc.SpecServeServicer):
    """Answers like the app: checks the key, streams one chunk per token."""

    def __init__(self):
        self.cancelled = []

    def Generate(self, request, context):
        if dict(context.invocation_metadata()).get("authorization") != KEY:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        return pb.GenerateResponse(text=request.text.upper(), finish_reason="stop")

    def GenerateStream(self, request, context):
        context.add_callback(lambda: self.cancelled.append(not context.is_active()))
        for index in range(request.sampling.max_new_tokens):
            yield pb.GenerateChunk(token_ids=[index], text=str(index))


@pytest.fixture(scope="module")
def channels(self_signed_cert):
    upstream_port, tls_port = free_port(), free_port()
    upstream = grpc.server(futures.ThreadPoolExecutor(4))
    servicer = Upstream()
    specserve_pb2_grpc.add_SpecServeServicer_to_server(servicer, upstream)
    upstream.add_insecure_port(f"127.0.0.1:{upstream_port}")
    upstream.start()
    certfile, keyfile = self_signed_cert
    forwarder = serve_tls(certfile, keyfile, tls_port, f"127.0.0.1:{upstream_port}", host="127.0.0.1", workers=4)
    secure = grpc.secure_channel(f"localhost:{tls_port}", grpc.ssl_channel_credentials(certfile.read_bytes()))
    plain = grpc.insecure_channel(f"127.0.0.1:{tls_port}")
    yield specserve_pb2_grpc.SpecServeStub(secure), specserve_pb2_grpc.SpecServeStub(plain), servicer
    secure.close()
    plain.close()
    forwarder.stop(None)
    upstream.stop(None)


def test_calls_and_streams_pass_through_tls_with_their_metadata(channels):
    stub, _, _ = channels
    assert stub.Generate(pb.GenerateRequest(text="hi"), metadata=[("authorization", KEY)], timeout=10).text == "HI"
    chunks = list(stub.GenerateStream(pb.GenerateRequest(sampling=pb.Sampling(max_new_tokens=3)), timeout=10))
    assert [c.text for c in chunks] == ["0", "1", "2"]


def test_status_codes_come_back_unchanged(channels):
    stub, _, _ = channels
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(pb.GenerateRequest(text="hi"), metadata=[("authorization", "Bearer wrong")], timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in refused.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        stub.ListModels(pb.ListModelsRequest(), timeout=10)  # the upstream does not implement it
    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_clients_are_refused(channels):
    _, plain, _ = channels
    with pytest.raises(grpc.RpcError) as refused:
        plain.Generate(pb.GenerateRequest(text="hi"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_leaves_cancels_the_upstream_stream(channels):
    stub, _, servicer = channels
    stream = stub.GenerateStream(pb.GenerateRequest(sampling=pb.Sampling(max_new_tokens=10 ** 6)), timeout=30)
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 10
    while not servicer.cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servicer.cancelled == [True]
