"""Attention backends: the seam where a GPU kernel (flash-attn) can replace torch SDPA.

A backend attends the new tokens of one sequence to that sequence's cached prefix plus the new
tokens themselves, under an explicit boolean mask (True = may attend).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """query [heads, n, d]; keys/values [kv_heads, S, d]; mask [n, S] or None (attend all)."""


class SdpaBackend:
    """torch.nn.functional.scaled_dot_product_attention with grouped-query heads."""

    name = "sdpa"

    def attend(self, query, keys, values, mask):
        out = F.scaled_dot_product_attention(
            query.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=None if mask is None else mask.unsqueeze(0).unsqueeze(0),
            enable_gqa=query.shape[0] != keys.shape[0],
        )
        return out.squeeze(0)


_BACKENDS = {"sdpa": SdpaBackend}


def get_backend(name: str = "sdpa") -> AttentionBackend:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}") from None
