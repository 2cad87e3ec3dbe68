"""Log-probabilities in OpenAI's two shapes: chat's `content` list of token objects (with bytes and
`top_logprobs`), and completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`), where the chosen token always joins its position's alternatives (so up to k + 1)."""
from __future__ import annotations

from collections.abc import Sequence

from cluster.serve.token_strings import TokenStrings
from speculators.logprobs import TokenLogprob


def chat_logprobs(entries: Sequence[TokenLogprob], strings: TokenStrings) -> dict:
    def token(token_id: int, logprob: float) -> dict:
        return {"token": strings.text(token_id), "logprob": logprob, "bytes": strings.bytes(token_id)}

    return {"content": [token(e.token, e.logprob) | {"top_logprobs": [token(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], strings: TokenStrings, offset: int = 0) -> dict:
    """`offset`: characters of the completion before these tokens (a streamed chunk's start)."""
    texts = [strings.text(e.token) for e in entries]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top = [{strings.text(t): lp for t, lp in e.top} | {text: e.logprob} for text, e in zip(texts, entries)]
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top, "text_offset": offsets}
