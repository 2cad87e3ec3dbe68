"""Attention backends: the seam where a GPU kernel (flash-attn) can replace torch SDPA.

A backend attends a padded batch of new tokens to each sequence's cached positions (prefix and
new tokens alike, already in the cache) under an explicit boolean mask (True = may attend).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """query [B, heads, n, d]; keys/values [B, kv_heads, S, d]; mask [B, n, S] or None (attend all)."""


class SdpaBackend:
    """torch.nn.functional.scaled_dot_product_attention with grouped-query heads."""

    name = "sdpa"

    def attend(self, query, keys, values, mask):
        return F.scaled_dot_product_attention(
            query, keys, values,
            attn_mask=None if mask is None else mask.unsqueeze(1),
            enable_gqa=query.shape[1] != keys.shape[1],
        )


_BACKENDS = {"sdpa": SdpaBackend}


def get_backend(name: str = "sdpa") -> AttentionBackend:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}") from None
