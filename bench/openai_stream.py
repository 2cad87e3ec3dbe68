"""A streamed OpenAI chat completion over plain HTTP: the benchmarks' client, with no SDK in between."""
from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from urllib.parse import urlsplit


class StreamFailed(RuntimeError):
    """The server refused the request (`kind` 'http:STATUS') or said so inside the stream ('http:stream-error')."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind} {detail}".strip())
        self.kind = kind


def stream_chat(url: str, body: dict, api_key: str | None, timeout_s: float,
                path: str = "/v1/chat/completions") -> Iterator[tuple[float, dict]]:
    """(time.perf_counter() on arrival, event) for each server-sent event of a streamed completion."""
    address = urlsplit(url)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    connection = http.client.HTTPConnection(address.hostname, address.port or 80, timeout=timeout_s)
    try:
        connection.request("POST", path, json.dumps(body), headers)
        response = connection.getresponse()
        if response.status != 200:
            raise StreamFailed(f"http:{response.status}", response.read(300).decode(errors="replace"))
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                raise StreamFailed("http:stream-error", str(event["error"]))
            yield time.perf_counter(), event
    finally:
        connection.close()
