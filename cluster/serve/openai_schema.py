"""OpenAI's wire format: request bodies into the service's RequestOptions, outputs into OpenAI's
response objects. Pure translation; the routes that use it are in openai_api.py.

Fields OpenAI defines but this server cannot honour (tools, logit_bias, echo...) are accepted at
their neutral values, which clients send by default, and refused otherwise: a silently ignored
`logit_bias` would return output the client did not ask for. README's "OpenAI compatibility" table
lists every field and how it is served.
"""
# no `from __future__ import annotations`: FastAPI must see real classes after Serve pickles the routes

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.engine.request import GenerationOutput
from cluster.engine.stats import mean_accepted_tokens
from cluster.serve.models import ServedModels
from cluster.serve.openai_logprobs import chat_logprobs, completion_logprobs
from cluster.serve.requests import TENANT_HEADER
from cluster.serve.samples import Samples
from cluster.serve.service import InvalidRequest, SpecService
from cluster.serve.token_strings import TokenStrings
from speculators.logprobs import TokenLogprob

FINISH_REASONS = ("stop", "length")
"""Endings OpenAI knows; any other ('error', 'abort') means the request failed."""
OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Fields that select what this server does, per endpoint; anything not listed here or below is refused.
COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "speculation",
                 "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "response_format",
                 "structured_outputs", "cache_salt"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "max_tokens", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_tokens", "max_completion_tokens", "top_logprobs"}
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
"""Bookkeeping that does not change the output."""
NEUTRAL_ONLY = {
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
}
"""Features this server lacks, with the values that ask for none of them."""
PASSED_THROUGH = ("temperature", "top_p", "top_k", "seed", "stop", "speculation", "n", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "cache_salt")
"""Body fields that are RequestOptions fields of the same name and meaning."""
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}
"""vLLM's `structured_outputs` keys and the kinds they name."""


def _renamed(error: InvalidRequest, renames: dict[str, str]) -> InvalidRequest:
    """The service's complaint in the client's words: it names RequestOptions fields (max_new_tokens,
    prompt_token_ids), the client sent OpenAI ones (max_tokens, prompt)."""
    head, dot, rest = error.field.partition(".")
    if head not in renames:
        return error
    message = str(error).removeprefix(f"{error.field}: ")
    return InvalidRequest(renames[head] + dot + rest, message)


# ---- request bodies ----------------------------------------------------------------------------


@dataclass
class Call:
    """One parsed request: what to generate, by which model, and how the client wants it back."""

    service: SpecService
    samples: Samples
    stream: bool
    include_usage: bool
    logprobs: bool
    """Whether the client asked for log-probabilities (best_of asks the engine for them anyway)."""
    renames: dict[str, str] = field(default_factory=dict)
    """The wire name of each RequestOptions field the body gave under another (`_options`)."""

    async def await_grammars(self) -> None:
        """Its grammar, when parsed with `wait_for_grammar` False, awaited on the event loop; a refusal
        names the body's field (response_format or structured_outputs)."""
        try:
            await self.service.await_grammars(self.samples.requests)
        except InvalidRequest as error:
            raise _renamed(error, self.renames) from None

    @property
    def prompt_tokens(self) -> int:
        return len(self.samples.requests[0].prompt_ids)


def _json_object(raw: bytes) -> dict:
    """The body as a dict; 400 rather than FastAPI's 422, since OpenAI clients expect 400."""
    try:
        body = json.loads(raw)
    except ValueError as error:  # JSONDecodeError and undecodable bytes (invalid UTF-8)
        raise InvalidRequest("body", f"is not valid JSON ({error})") from None
    except RecursionError:
        raise InvalidRequest("body", "is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidRequest("model", "must be a string")
    return body


def _check_fields(body: dict, accepted: set[str]) -> None:
    for name, value in body.items():
        if name in accepted or name in IGNORED_FIELDS:
            continue
        if name not in NEUTRAL_ONLY:
            raise InvalidRequest(name or '""', "is not a recognised request argument")
        if value not in NEUTRAL_ONLY[name]:
            allowed = " or ".join(json.dumps(v) for v in NEUTRAL_ONLY[name])
            raise InvalidRequest(name, f"is not supported by this server; send {allowed}")


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(name, "must be a boolean")
    return bool(value)


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options", "must be an object")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest("stream_options.include_usage", "must be a boolean")
    return bool(value)


def _prompt_fields(prompt) -> dict:
    """OpenAI's prompt: text, token ids, or a batch of either; a batch must hold exactly one."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise InvalidRequest("prompt", "batches of prompts are not supported; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt}
    return {"prompt": prompt}


def _message(message: object) -> object:
    """A chat message as the service takes it: text content, and OpenAI's newer 'developer' role
    as the 'system' role chat templates know. Anything else is left for the service to refuse."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(part.get("text", "")) for part in content)
    role = "system" if message.get("role") == "developer" else message.get("role")
    return {"role": role, "content": content}


def _logprobs(body: dict, chat: bool) -> tuple[int | None, str]:
    """The alternatives wanted per position (None: no logprobs) and the wire field that said so.

    Chat: `logprobs: true` and `top_logprobs: k`. Completions: `logprobs: k` (0: the chosen token only).
    """
    if not chat:
        return body.get("logprobs"), "logprobs"
    wanted, top = _flag(body, "logprobs"), body.get("top_logprobs")
    if top is not None and not wanted:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    return (top if top is not None else 0) if wanted else None, "top_logprobs" if top is not None else "logprobs"


def _response_format(value) -> dict | None:
    """OpenAI's response_format as a StructuredOutput (None for text)."""
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("response_format", "must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                                "{\"type\": \"json_schema\", "
                                                "\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"kind": "json_object"}
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema", "must be a JSON schema object")
    return {"kind": "json_schema", "value": json.dumps(schema)}


def _structured_outputs(value) -> dict:
    """vLLM's extra field: exactly one of json (a schema), regex or grammar (EBNF)."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in STRUCTURED_KINDS:
        raise InvalidRequest("structured_outputs", "must hold exactly one of json, regex or grammar")
    key, spec = next(iter(value.items()))
    if key == "json" and isinstance(spec, dict):
        spec = json.dumps(spec)
    if not isinstance(spec, str):
        raise InvalidRequest(f"structured_outputs.{key}", "must be a string" + (" or a schema object" if key == "json" else ""))
    return {"kind": STRUCTURED_KINDS[key], "value": spec}


def _structure(body: dict) -> tuple[dict | None, str]:
    given = [name for name in ("response_format", "structured_outputs") if body.get(name) is not None]
    if len(given) > 1:
        raise InvalidRequest("structured_outputs", "give response_format or structured_outputs, not both")
    if not given:
        return None, "response_format"
    parse = _response_format if given[0] == "response_format" else _structured_outputs
    return parse(body[given[0]]), given[0]


def _options(body: dict, chat: bool, service: SpecService) -> tuple[dict, dict[str, str]]:
    """RequestOptions fields from an OpenAI body, and the wire name of each field renamed on the way.

    Unset or null fields take OpenAI's defaults where OpenAI defines one (temperature 1, 16 tokens
    for completions); chat has no token default, so it may use the whole per-request limit. An unset
    token count is cut to what fits the context window after the prompt, as vLLM does.
    """
    if chat:
        messages = body.get("messages")
        fields = {"messages": [_message(m) for m in messages] if isinstance(messages, list) else messages}
        tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        default_tokens = service.limits.max_new_tokens
    else:
        fields = _prompt_fields(body.get("prompt"))
        tokens_name, default_tokens = "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS
        if body.get("best_of") is not None:
            fields["best_of"] = body["best_of"]
    given = {name: body[name] for name in PASSED_THROUGH if body.get(name) is not None}
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    if given.get("top_k") == -1:  # vLLM's spelling of "no top-k"
        given["top_k"] = 0
    logprobs, logprobs_name = _logprobs(body, chat)
    structure, structure_name = _structure(body)
    max_tokens = body.get(tokens_name)
    fields |= {"temperature": OPENAI_DEFAULT_TEMPERATURE, "logprobs": logprobs, "structured_output": structure,
               "max_new_tokens": max_tokens, "default_max_new_tokens": default_tokens} | given
    return fields, {"max_new_tokens": tokens_name, "prompt_token_ids": "prompt", "logprobs": logprobs_name,
                    "structured_output": structure_name}


def parse_call(raw_body: bytes, models: ServedModels, chat: bool, request_id: str,
               headers: Mapping[str, str] | None = None, key_tenant: str | None = None, *,
               wait_for_grammar: bool = True) -> Call:
    """The request a body asks for, from the tenant its API key names (`ServedModels.authorize`),
    checked field by field (InvalidRequest names the wire field;
    ModelNotFound names a model that is not served). It tokenizes the prompt and starts compiling any
    grammar, so the routes call it on a worker thread, not on the event loop; with `wait_for_grammar`
    False they then await the compile there (`Call.await_grammars`) rather than hold the thread."""
    body = _json_object(raw_body)
    service = models.resolve(body.get("model"))
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    stream, include_usage = _flag(body, "stream"), _include_usage(body)
    fields, renames = _options(body, chat, service)
    headers = headers or {}  # who sent it: the cache scope of suffix decoding (limits.cache_sharing)
    fields["tenant"] = service.tenant(key_tenant, headers.get(TENANT_HEADER), body.get("user"))
    try:
        samples = service.build_samples(service.parse_options(fields), request_id, wait_for_grammar=wait_for_grammar)
    except InvalidRequest as error:
        raise _renamed(error, renames) from None
    if stream and len(samples.requests) > samples.n:
        raise InvalidRequest("best_of", "cannot be streamed (the best samples are known only at the end); "
                                        "drop stream or best_of")
    return Call(service=service, samples=samples, stream=stream, include_usage=include_usage,
                logprobs=fields["logprobs"] is not None, renames=renames)


# ---- responses ---------------------------------------------------------------------------------


@dataclass
class ResponseShape:
    """OpenAI's response objects for one request, text completion or chat."""

    id: str
    created: int
    model: str
    chat: bool
    strings: TokenStrings | None = None
    """Token texts for log-probabilities (None: the client did not ask for them)."""

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def logprobs(self, entries: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        """`entries` in this endpoint's shape; `offset`: characters of the completion before them."""
        if self.strings is None or entries is None:
            return None
        return chat_logprobs(entries, self.strings) if self.chat else completion_logprobs(entries, self.strings, offset)

    def response(self, choices: list[GenerationOutput], prompt_tokens: int, samples: list[GenerationOutput]) -> dict:
        """`choices` in choice order; `samples`: every output the engine made for them (stats)."""
        body = []
        for index, output in enumerate(choices):
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": output.text}}
            else:
                choice = {"index": index, "text": output.text}
            choice |= {"finish_reason": output.finish_reason, "finish_detail": output.finish_detail,
                       "logprobs": self.logprobs(output.logprobs)}
            body.append(choice)
        envelope = self._envelope("chat.completion" if self.chat else "text_completion", body)
        return envelope | {"usage": usage(choices, prompt_tokens), "speculation": speculation_stats(samples)}

    def chunk(self, index: int, text: str = "", finish_reason: str | None = None, role: bool = False,
              finish_detail: str | None = None, logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text else {})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice |= {"finish_reason": finish_reason, "logprobs": logprobs}
        if finish_detail:
            choice["finish_detail"] = finish_detail
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, choices: list[GenerationOutput], prompt_tokens: int) -> dict:
        """What stream_options.include_usage asks for: a last chunk with no choices (and, as a
        whole response does, what speculation did)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, []) | {"usage": usage(choices, prompt_tokens), "speculation": speculation_stats(choices)}


def usage(choices: list[GenerationOutput], prompt_tokens: int) -> dict:
    """The prompt once (its prefill is shared) and every choice's tokens; as OpenAI reports it, the
    prompt tokens found in the prefix cache (the fewest any choice found)."""
    completion_tokens = sum(len(output.token_ids) for output in choices)
    cached = min((output.stats.cached_prompt_tokens for output in choices), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def speculation_stats(outputs: list[GenerationOutput]) -> dict:
    """What speculation did for these outputs, summed (the engine's work for one call).

    `time_to_first_token_s` is the gRPC name; `time_to_first_token` is its deprecated HTTP alias."""
    stats = [output.stats for output in outputs]
    forwards, tokens = sum(s.target_forwards for s in stats), sum(len(o.token_ids) for o in outputs)
    first = min((s.time_to_first_token for s in stats if s.time_to_first_token is not None), default=None)
    return {"drafted": sum(s.drafted for s in stats), "accepted": sum(s.accepted for s in stats),
            "mean_accepted_tokens": mean_accepted_tokens(tokens, forwards), "target_forwards": forwards,
            "grammar_pruned": sum(s.grammar_pruned for s in stats), "preemptions": sum(s.preemptions for s in stats),
            "time_to_first_token_s": first, "time_to_first_token": first}


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
