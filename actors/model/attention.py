"""Attention backends: the seam where a GPU kernel can replace torch SDPA.

A backend attends the packed new tokens of a forward pass to their sequences' cached positions
(prefix and new tokens alike, already in the cache), each under its sequence's mask, and returns
the packed outputs. `sdpa` (the default everywhere) attends each sequence's whole cached span under
its mask: on a CPU, a verification pass's rows in one call of our kernel and prompt chunks one call
per sequence over a view of its blocks (cpu_attention.py), on a GPU one padded call for the batch
(batch.py says why); `split` (split_attention.py) attends the committed prefix without a mask (through
vllm_flash_attn when it imports on CUDA) and merges it with the masked tree block by log-sum-exp.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from actors.model.cpu_attention import attend_cpu
from actors.model.split_attention import SplitBackend

if TYPE_CHECKING:
    from actors.model.batch import PackedBatch, SequenceView
    from actors.model.kv_cache import KVCache


class AttentionBackend(Protocol):
    name: str

    def attend(self, q: torch.Tensor, batch: PackedBatch, cache: KVCache, layer: int) -> torch.Tensor:
        """q: packed queries [tokens, heads, d]; returns packed outputs [tokens, heads * d]."""


class SdpaBackend:
    """torch.nn.functional.scaled_dot_product_attention with grouped-query heads, or on a CPU our
    kernel for decoding rows (cpu_attention.py: a token's result never depends on the pass); on a
    GPU, one sequence over a view of its blocks, else one padded call."""

    name = "sdpa"

    def attend(self, q, batch, cache, layer):
        """q [tokens, heads, d] -> [tokens, heads * d], as AttentionBackend.attend."""
        if batch.per_sequence and batch.device.type == "cpu":
            return attend_cpu(q, batch, cache, layer)
        if batch.per_sequence:
            return _attend_sequence(q, batch.sequences[0], cache, layer)
        query = batch.queries(q)
        keys, values = batch.read(cache, layer)
        return batch.outputs(F.scaled_dot_product_attention(
            query, keys, values,
            attn_mask=None if batch.mask is None else batch.mask.unsqueeze(1),
            enable_gqa=query.shape[1] != keys.shape[1],
        ))


def _attend_sequence(q: torch.Tensor, view: SequenceView, cache: KVCache, layer: int) -> torch.Tensor:
    """The one sequence of a GPU pass: its packed queries [n, heads, d] against a view of its run of
    blocks (gathered when they are not adjacent) -> [n, heads * d]."""
    query = q[view.rows].transpose(0, 1).unsqueeze(0)
    _, start, length = view.runs[0]
    storage = slice(start, start + length) if len(view.runs) == 1 else cache.index(view.blocks, view.end).to(query.device)
    keys, values = cache.keys[layer][:, storage][None], cache.values[layer][:, storage][None]
    attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=None if view.mask is None else view.mask[None, None],
                                              enable_gqa=query.shape[1] != keys.shape[1])
    return attended[0].transpose(0, 1).reshape(query.shape[2], -1)


_BACKENDS = {"sdpa": SdpaBackend, "split": SplitBackend}
BACKEND_NAMES = tuple(_BACKENDS)


def get_backend(name: str = "sdpa") -> AttentionBackend:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}") from None
