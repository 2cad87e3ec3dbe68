"""What SpecServer's gRPC methods use of a grpc.aio context: the key presented, and the status set."""
from __future__ import annotations


class GrpcContext:
    code = None
    details = None

    def __init__(self, key: str | None):
        self.key = key

    def invocation_metadata(self):
        return [("authorization", self.key)] if self.key else []

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, metadata):
        pass
