"""Attention backends: the seam where a GPU kernel can replace torch SDPA.

A backend attends the packed new tokens of a forward pass to their sequences' cached positions
(prefix and new tokens alike, already in the cache), each under its sequence's mask, and returns
the packed outputs. `sdpa` (the default everywhere) attends each sequence's whole cached span under
its mask: one call per sequence over a view of its slot on a CPU, one padded call for the batch on
a GPU (batch.py says why); `split` (split_attention.py) attends the committed prefix without a mask (through
vllm_flash_attn when it imports on CUDA) and merges it with the masked tree block by log-sum-exp.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from actors.model.split_attention import NEG_INF, SplitBackend, accumulation_dtype, merge_by_lse

if TYPE_CHECKING:
    from actors.model.batch import PackedBatch, SequenceView
    from actors.model.kv_cache import KVCache


class AttentionBackend(Protocol):
    name: str

    def attend(self, q: torch.Tensor, batch: PackedBatch, cache: KVCache, layer: int) -> torch.Tensor:
        """q: packed queries [tokens, heads, d]; returns packed outputs [tokens, heads * d]."""


class SdpaBackend:
    """torch.nn.functional.scaled_dot_product_attention with grouped-query heads: per sequence over
    views of its cache blocks where the batch says so (a CPU), else one padded call."""

    name = "sdpa"

    def attend(self, q, batch, cache, layer):
        """q [tokens, heads, d] -> [tokens, heads * d], as AttentionBackend.attend."""
        if batch.per_sequence:
            outputs = [_attend_sequence(q, view, cache, layer) for view in batch.sequences]
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        query = batch.queries(q)
        keys, values = batch.read(cache, layer)
        return batch.outputs(F.scaled_dot_product_attention(
            query, keys, values,
            attn_mask=None if batch.mask is None else batch.mask.unsqueeze(1),
            enable_gqa=query.shape[1] != keys.shape[1],
        ))


LONG_RUN = 128
"""Runs of adjacent storage at least this long are attended where they lie; shorter ones are
gathered into one part (copying a few blocks costs less than a kernel call and a merge each)."""


def _attend_sequence(q: torch.Tensor, view: SequenceView, cache: KVCache, layer: int) -> torch.Tensor:
    """One sequence's packed queries [n, heads, d] against its cached positions -> [n, heads * d].

    A sequence stored as one run of adjacent blocks is one SDPA call over a view. A fragmented one
    (a prefix shared with other requests, blocks taken wherever the pool had them in a long-running
    server) is attended in parts through the CPU flash kernel, each under its columns of the mask:
    each long run in place, the short runs gathered into one part. The kernel returns the
    log-sum-exp, by which the parts are merged: exact, and a long history is never copied.
    """
    query = q[view.rows].transpose(0, 1).unsqueeze(0)
    if len(view.runs) > 1 and query.device.type == "cpu":
        attended = _attend_parts(query, view, cache, layer)
    else:  # one run: a view; fragmented on a GPU (one sequence in the pass): gathered, as the padded path does
        _, start, length = view.runs[0]
        storage = (slice(start, start + length) if len(view.runs) == 1
                   else cache.index(view.blocks, view.end).to(query.device))
        keys, values = cache.keys[layer][:, storage][None], cache.values[layer][:, storage][None]
        if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
            attended = _attend_folded(query, keys, values, view.mask)
        else:
            attended = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=None if view.mask is None else view.mask[None, None],
                enable_gqa=query.shape[1] != keys.shape[1],
            )
    return attended[0].transpose(0, 1).reshape(query.shape[2], -1)


def _attend_folded(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA with each kv head's query heads folded into rows: [1, heads, n, d] -> the same.

    The CPU kernel in bfloat16 is slow for few query rows (a decode step: one): folded, one token
    of a model with 3 query heads per kv head is 3 rows, and the call took a fifth of the time
    (docs/benchmarks.md, "Measurements behind the code")."""
    heads, n, dim = query.shape[1:]
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(1, kv_heads, groups * n, dim)  # rows: (group, token), as the heads lie
    attended = F.scaled_dot_product_attention(
        folded, keys, values, attn_mask=None if mask is None else mask.repeat(groups, 1)[None, None])
    return attended.reshape(1, heads, n, dim)


def _attend_parts(query: torch.Tensor, view: SequenceView, cache: KVCache, layer: int) -> torch.Tensor:
    heads, n, dim = query.shape[1:]
    kv_heads = cache.keys.shape[1]
    folded = query.reshape(1, kv_heads, heads // kv_heads * n, dim)  # a kv head's query heads as rows
    dtype = accumulation_dtype(query)
    out, lse = None, None
    for storage, masked in _parts(view, query.dtype, heads // kv_heads):
        part, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            folded, cache.keys[layer][:, storage][None], cache.values[layer][:, storage][None],
            attn_mask=None if masked is None else masked[0])
        if masked is not None:  # the kernel gives a row that sees nothing of the part lse 0, not -inf
            part_lse = part_lse.masked_fill(~masked[1], NEG_INF)
        part, part_lse = part.reshape(1, heads, n, dim).to(dtype), part_lse.reshape(1, heads, n).to(dtype)
        out, lse = (part, part_lse) if out is None else (merge_by_lse(out, lse, part, part_lse), torch.logaddexp(lse, part_lse))
    return out.to(query.dtype)


def _parts(view: SequenceView, dtype: torch.dtype, groups: int) -> list[tuple[slice | torch.Tensor, tuple | None]]:
    """The sequence's positions in parts: where each lies in storage (a slice: a long run; a tensor of
    positions: the short runs gathered), and None where every new token sees all of it, else the
    kernel's additive mask [1, 1, groups x n, length] (rows as the folded query has them) and which
    rows see any of it. Built once a pass (every layer uses it)."""
    key = ("parts", dtype, groups)
    if key in view.for_every_layer:
        return view.for_every_layer[key]
    pieces, short_storage, short_columns = [], [], []
    for logical, physical, length in view.runs:
        if length >= LONG_RUN:
            pieces.append((slice(physical, physical + length), slice(logical, logical + length)))
        else:
            short_storage.extend(range(physical, physical + length))
            short_columns.extend(range(logical, logical + length))
    if short_storage:
        pieces.append((torch.tensor(short_storage), torch.tensor(short_columns)))
    parts = []
    for storage, columns in pieces:
        allowed = None if view.mask is None else view.mask[:, columns]
        if allowed is None or bool(allowed.all()):
            parts.append((storage, None))
            continue
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, NEG_INF)
        parts.append((storage, (additive.repeat(groups, 1)[None, None], allowed.any(-1).repeat(groups))))
    view.for_every_layer[key] = parts
    return parts


_BACKENDS = {"sdpa": SdpaBackend, "split": SplitBackend}
BACKEND_NAMES = tuple(_BACKENDS)


def get_backend(name: str = "sdpa") -> AttentionBackend:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}") from None
