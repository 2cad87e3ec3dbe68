"""Which served model a request names: one SpecService per model, found by id.

An application may serve several models (AppArgs.models); each has its own SpecCluster and
SpecService in every replica, and requests are routed by their `model` field. A name that is not
served is refused as OpenAI refuses it (HTTP 404 `model_not_found`, gRPC NOT_FOUND). A request
that names no model gets the only one when there is one (as vLLM does) and is refused (400 naming
`model`) when there are several.
"""
from __future__ import annotations

from collections.abc import Sequence

from cluster.serve.service import InvalidRequest, SpecService


class ModelNotFound(LookupError):
    def __init__(self, name: str, served: Sequence[str]):
        super().__init__(f"the model {name!r} does not exist; this server serves {', '.join(map(repr, served))}")
        self.name, self.served = name, list(served)

    def __reduce__(self):  # crosses Ray process boundaries like InvalidRequest
        return type(self), (self.name, self.served)


class ServedModels:
    def __init__(self, services: Sequence[SpecService]):
        self.services = {service.model_id: service for service in services}
        if len(self.services) != len(services) or not services:
            raise ValueError(f"served model ids must be distinct and at least one: {[s.model_id for s in services]}")

    def resolve(self, name: str | None) -> SpecService:
        """The service of model `name`; None or "" means the only model."""
        if not name:
            if len(self.services) == 1:
                return next(iter(self.services.values()))
            raise InvalidRequest("model", f"this server serves several models; name one of {', '.join(self.services)}")
        service = self.services.get(name)
        if service is None:
            raise ModelNotFound(name, list(self.services))
        return service

    def authorize(self, header_value: str | None) -> str | None:
        """The key's tenant (SpecService.authorize): every model of an application shares its limits,
        API keys included."""
        return next(iter(self.services.values())).authorize(header_value)

    @property
    def limits(self):
        """The application's limits (every model shares them)."""
        return next(iter(self.services.values())).limits

    def __iter__(self):
        return iter(self.services.values())
