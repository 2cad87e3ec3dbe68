"""Attention backends: the seam where a GPU kernel can replace torch SDPA.

A backend attends the packed new tokens of a forward pass to their sequences' cached positions
(prefix and new tokens alike, already in the cache), each under its sequence's mask, and returns
the packed outputs. `sdpa` (the default everywhere) makes one masked SDPA call over each sequence's
whole cached span; `split` (split_attention.py) attends the committed prefix without a mask (through
vllm_flash_attn when it imports on CUDA) and merges it with the masked tree block by log-sum-exp.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from actors.model.split_attention import SplitBackend

if TYPE_CHECKING:
    from actors.model.batch import PackedBatch
    from actors.model.kv_cache import KVCache


class AttentionBackend(Protocol):
    name: str

    def attend(self, q: torch.Tensor, batch: PackedBatch, cache: KVCache, layer: int) -> torch.Tensor:
        """q: packed queries [tokens, heads, d]; returns packed outputs [tokens, heads * d]."""


class SdpaBackend:
    """torch.nn.functional.scaled_dot_product_attention with grouped-query heads."""

    name = "sdpa"

    def attend(self, q, batch, cache, layer):
        query = batch.queries(q)
        keys, values = batch.read(cache, layer)
        return batch.outputs(F.scaled_dot_product_attention(
            query, keys, values,
            attn_mask=None if batch.mask is None else batch.mask.unsqueeze(1),
            enable_gqa=query.shape[1] != keys.shape[1],
        ))


_BACKENDS = {"sdpa": SdpaBackend, "split": SplitBackend}
BACKEND_NAMES = tuple(_BACKENDS)


def get_backend(name: str = "sdpa") -> AttentionBackend:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}") from None
