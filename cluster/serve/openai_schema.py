"""OpenAI's wire format: request bodies into the service's RequestOptions, outputs into OpenAI's
response objects. Pure translation; the routes that use it are in openai_api.py.

Fields OpenAI defines but this server cannot honour (logprobs, penalties, n > 1...) are accepted at
their neutral values, which clients send by default, and refused otherwise: a silently ignored
`presence_penalty` would return output the client did not ask for.
"""
# no `from __future__ import annotations`: FastAPI must see real classes after Serve pickles the routes

import json
from dataclasses import dataclass

from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.serve.service import InvalidRequest, SpecService

FINISH_REASONS = ("stop", "length")
"""Endings OpenAI knows; any other ('error', 'abort') means the request failed."""
OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Fields that select what this server does, per endpoint; anything not listed here or below is refused.
COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "speculation"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "max_tokens"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_tokens", "max_completion_tokens"}
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
"""Bookkeeping that does not change the output."""
NEUTRAL_ONLY = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
}
"""Features this server lacks, with the values that ask for none of them."""


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
    """One parsed request: what to generate and how the client wants it back."""

    request: GenerationRequest
    stream: bool
    include_usage: bool


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


def _options(body: dict, chat: bool, service: SpecService) -> tuple[dict, dict[str, str]]:
    """RequestOptions fields from an OpenAI body, and the wire name of each field renamed on the way.

    Unset or null fields take OpenAI's defaults where OpenAI defines one (temperature 1, 16 tokens
    for completions); chat has no token default, so it may use the whole per-request limit.
    """
    if chat:
        messages = body.get("messages")
        fields = {"messages": [_message(m) for m in messages] if isinstance(messages, list) else messages}
        tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        default_tokens = service.limits.max_new_tokens
    else:
        fields = _prompt_fields(body.get("prompt"))
        tokens_name, default_tokens = "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS
    given = {name: body[name] for name in ("temperature", "top_p", "top_k", "seed", "stop", "speculation")
             if body.get(name) is not None}
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    if given.get("top_k") == -1:  # vLLM's spelling of "no top-k"
        given["top_k"] = 0
    max_tokens = body.get(tokens_name)
    fields |= {"temperature": OPENAI_DEFAULT_TEMPERATURE,
               "max_new_tokens": default_tokens if max_tokens is None else max_tokens} | given
    return fields, {"max_new_tokens": tokens_name, "prompt_token_ids": "prompt"}


def parse_call(raw_body: bytes, service: SpecService, chat: bool, request_id: str) -> Call:
    """The request a body asks for, checked field by field (InvalidRequest names the wire field)."""
    body = _json_object(raw_body)
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    stream, include_usage = _flag(body, "stream"), _include_usage(body)
    fields, renames = _options(body, chat, service)
    try:
        generation = service.build_request(service.parse_options(fields), request_id)
    except InvalidRequest as error:
        raise _renamed(error, renames) from None
    return Call(generation, stream, include_usage)


# ---- responses ---------------------------------------------------------------------------------


@dataclass
class ResponseShape:
    """OpenAI's response objects for one request, text completion or chat."""

    id: str
    created: int
    model: str
    chat: bool

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def response(self, output: GenerationOutput, prompt_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": output.text}}
        else:
            choice = {"index": 0, "text": output.text}
        choice |= {"finish_reason": output.finish_reason, "finish_detail": output.finish_detail, "logprobs": None}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return body | {"usage": _usage(output, prompt_tokens), "speculation": speculation_stats(output)}

    def chunk(self, text: str = "", finish_reason: str | None = None, role: bool = False,
              finish_detail: str | None = None) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"finish_reason": finish_reason, "logprobs": None}
        if finish_detail:
            choice["finish_detail"] = finish_detail
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, output: GenerationOutput, prompt_tokens: int) -> dict:
        """What stream_options.include_usage asks for: a last chunk with no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, []) | {"usage": _usage(output, prompt_tokens)}


def _usage(output: GenerationOutput, prompt_tokens: int) -> dict:
    completion_tokens = len(output.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation_stats(output: GenerationOutput) -> dict:
    stats = output.stats
    return {"drafted": stats.drafted, "accepted": stats.accepted, "mean_accepted_tokens": output.mean_accepted_tokens,
            "target_forwards": stats.target_forwards, "time_to_first_token": stats.time_to_first_token}


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
