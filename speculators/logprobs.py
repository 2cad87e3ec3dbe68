"""Log-probabilities of committed tokens, read from the verification pass that committed them.

Row j of a verification pass's logits is the target's next-token distribution after tree node j, so
the tokens a pass commits (the accepted drafted tokens, then the bonus or recovered token) have
their distributions at the rows of the accepted path: no extra forward pass, and the same numbers
whether the token was drafted and accepted or decoded one step at a time.

They are the raw model distribution: log_softmax of the logits before penalties, a grammar's
mask, temperature, top-k and top-p (vLLM's default `raw_logprobs`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for at each position (OpenAI's and vLLM's limit)."""


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]
    """The `k` likeliest tokens and their log-probabilities, likeliest first."""


def committed_logprobs(logits: torch.Tensor, path: list[int], tokens: list[int], k: int) -> list[TokenLogprob]:
    """The log-probability of `tokens[j]` under row `path[j]` of `logits` [N, V], and each row's top `k`."""
    rows = logits[path].double().log_softmax(-1)
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device).unsqueeze(1)).squeeze(1).tolist()
    if k:
        values, indices = rows.topk(k, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        top = [[] for _ in tokens]
    return [TokenLogprob(token, logprob, alternatives) for token, logprob, alternatives in zip(tokens, chosen, top)]
