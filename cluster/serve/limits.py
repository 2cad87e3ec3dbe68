"""What one replica accepts: request sizes, concurrency, deadlines, the API keys, and whose cached
prefixes and earlier outputs a request may use (its cache scope, see requests.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from cluster.serve.api_key import ApiKeys, resolve_api_keys


class ServiceLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_prompt_tokens: int | None = Field(
        None, ge=1, description="longest prompt accepted, in tokens; null: as vLLM, any prompt whose tokens and "
        "max_tokens fit the context window (cluster.engine.max_len); a request that does not fit is refused with "
        "400 / INVALID_ARGUMENT naming max_tokens, or prompt when the prompt alone fills the window")
    max_new_tokens: int = Field(512, ge=1, description="most tokens one request may ask for")
    max_concurrent_requests: int = Field(
        64, ge=1, description="requests in flight per replica; more are refused with 503 / RESOURCE_EXHAUSTED")
    max_stop_strings: int = Field(16, ge=0, description="most stop strings one request may give")
    max_stop_string_chars: int = Field(
        64, ge=1, description="longest stop string, in characters: streamed text is held back by this much "
        "while it could still turn into a stop string")
    request_timeout_s: float = Field(
        600.0, gt=0, description="a request still running after this many seconds is aborted with a retryable error")
    max_n: int = Field(16, ge=1, le=128, description="most choices (n, best_of) one request may ask for")
    max_grammar_chars: int = Field(
        65536, ge=1, description="longest JSON schema, regular expression or grammar a request may give, in characters")
    grammar_compile_timeout_s: float = Field(
        30.0, gt=0, description="a structured-output spec not compiled within this many seconds (waiting for a compile "
        "thread included) is refused with 400 naming response_format / structured_outputs (gRPC INVALID_ARGUMENT "
        "naming structured_output); it goes on compiling and is cached, so the same spec sent later may be ready")
    grammar_compile_threads: int = Field(
        2, ge=1, le=64, description="threads compiling structured-output specs, per served model, apart from those "
        "parsing requests: slow compiles wait for each other, not parsing")
    max_body_bytes: int = Field(
        2 * 2**20, ge=1024, description="largest HTTP request body, in bytes (a larger one is refused with 413 before "
        "it is read whole), and largest gRPC request (INVALID_ARGUMENT naming request, before it is tokenized; "
        "Serve's gRPC proxy itself takes up to RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, 2 GiB by default)")
    max_messages: int = Field(256, ge=1, description="most chat messages one request may give")
    api_key: SecretStr | None = Field(
        None, description="when set, clients must send it (HTTP bearer, gRPC metadata 'authorization'); "
        "prefer api_key_env or api_key_file, which keep the key out of the Serve config")
    api_key_env: str | None = Field(None, description="name of an environment variable holding the API key")
    api_key_file: str | None = Field(
        None, description="path of a file holding the API key (a mounted Kubernetes Secret)")
    api_keys_file: str | None = Field(
        None, description="path of a YAML or JSON file mapping each API key to its tenant's name (a mounted Kubernetes "
        "Secret): several keys, each client its tenant; re-read within a second of a change, no restart (a file that "
        "no longer reads keeps the last good keys). At most one of api_key, api_key_env, api_key_file, api_keys_file")
    api_docs: bool = Field(
        False, description="serve FastAPI's /docs (Swagger UI) and /openapi.json, behind the API key like every route "
        "but /health (a browser's Swagger UI then cannot fetch the schema: fetch it with the key); off: 404")
    cache_sharing: Literal["tenant", "global", "request"] = Field(
        "tenant", description="whose cached prompt prefixes (the prefix cache) and earlier outputs (suffix decoding) "
        "a request may use (cached_tokens and the drafted and accepted counts would otherwise tell a client whether a "
        "text appeared in others' requests): tenant (the same tenant's, as tenant_from identifies it; a request without "
        "one shares nothing), global (everyone's), or request (none: only the request's own text)")
    tenant_from: Literal["api_key", "header", "user"] = Field(
        "api_key", description="cache_sharing tenant: what identifies a tenant: api_key (the tenant the client's API "
        "key names; a deployment without keys is one tenant, whatever bearer token a client sends), header "
        "(the 'x-specserve-tenant' HTTP header or gRPC metadata, set by a trusted gateway), or user (the OpenAI "
        "body's 'user' field). header and user are client-controlled unless a gateway in front sets or checks them: "
        "choose them only then")

    def resolved_api_keys(self) -> ApiKeys | None:
        """The keys from whichever source is configured; a named source that is missing or malformed is
        an error, never a silently open server."""
        return resolve_api_keys(self.api_key, self.api_key_env, self.api_key_file, self.api_keys_file)
