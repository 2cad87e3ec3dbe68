"""Attention on a CPU: a verification pass's rows through our kernel, prompt chunks through torch's.

Decoding and tree rows go to our kernel (kernels/paged_attention.cpp), every one of the pass in one
call a layer, where torch's CPU flash-attention kernel took a call per sequence: each row lists the
storage positions it attends in position order (a tree node's ancestors, wherever the tree's
scratch positions put them, count as if it had been decoded alone), and the kernel sums them in one
fixed order whatever else the call holds. So a verified token's attention has exactly the bits of
the same token decoded alone, and the call costs less (measured: docs/benchmarks.md, "Measurements
behind the code").

In bfloat16 and float16 prompt rows take our kernel too: a prompt token's K/V must not depend on how
the prompt was chunked (a cached prefix, a resumed request), which torch's kernel does not promise.
In float32, prompt chunks, where torch's kernel is faster, take it: one sequence at a time,
PROMPT_ROWS rows a call against the positions those rows see; a sequence whose blocks are not
adjacent (a cached prefix held where it lies) in parts merged by log-sum-exp. Without our kernel (no
compiler), or in float64, every row takes that path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from actors.model import kernels
from actors.model.split_attention import NEG_INF, accumulation_dtype, merge_by_lse

if TYPE_CHECKING:
    from actors.model.batch import PackedBatch, SequenceView
    from actors.model.kv_cache import KVCache

PROMPT_ROWS = 128
"""Prompt rows per call of torch's kernel: each call attends only the positions its rows see, so a
long chunk skips most of the positions its early rows do not see."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What our kernel computes in (float32 inside); float64, a reference's dtype, takes torch's."""
LONG_RUN = 128
"""Runs of adjacent storage at least this long are attended where they lie; shorter ones are
gathered into one part (copying a few blocks costs less than a call and a merge each)."""


class KernelLayout:
    """What our kernel reads for the pass's verification rows, built once a pass: the storage
    positions each row attends in position order (one list a sequence for the rows whose lists are
    prefixes of its longest row's, one of its own for a tree node off that branch), and per sequence
    the row whose list the others share up to `shared` (the kernel loads those blocks once)."""

    def __init__(self, views: list[SequenceView], cache: KVCache):
        self.rows = torch.cat([torch.arange(view.rows.start, view.rows.stop) for view in views])
        lists, starts, counts, shared, references, sizes, offset = [], [], [], [], [], [], 0
        for view in views:
            stored = cache.index(view.blocks, view.end)
            rows = view.rows.stop - view.rows.start
            first_row = sum(sizes)
            sizes.append(rows)
            if view.mask is None:  # every new token attends all [0, end)
                lists.append(stored)
                starts += [offset] * rows
                counts += [view.end] * rows
                shared += [view.end] * rows
                references.append(first_row)
                offset += view.end
                continue
            mask, visible = view.mask, view.mask.sum(1)
            longest = int(visible.argmax())
            references.append(first_row + longest)
            # a row's list is the longest row's up to the first column where their masks part
            parted = mask != mask[longest]
            first_parting = torch.where(parted.any(1), parted.int().argmax(1), mask.shape[1])
            common = torch.cat([torch.zeros(1, dtype=torch.long), mask[longest].long().cumsum(0)])[first_parting]
            lists.append(stored[mask[longest]])
            reference_start, offset = offset, offset + int(visible[longest])
            for row in range(rows):
                if common[row] < visible[row]:
                    lists.append(stored[mask[row]])
                    starts.append(offset)
                    offset += int(visible[row])
                else:
                    starts.append(reference_start)
            counts += visible.tolist()
            shared += torch.minimum(common, visible).tolist()
        self.positions = torch.cat(lists)
        self.starts, self.counts, self.shared = (torch.tensor(values) for values in (starts, counts, shared))
        self.sequences = torch.tensor([0, *sizes]).cumsum(0)
        self.references = torch.tensor(references)
        if not 0 <= int(self.positions.min()) <= int(self.positions.max()) < cache.keys.shape[2]:
            raise IndexError("a row attends a position outside the KV cache")


def attend_cpu(q: torch.Tensor, batch: PackedBatch, cache: KVCache, layer: int) -> torch.Tensor:
    """q [tokens, heads, d] -> [tokens, heads * d] (see the module doc)."""
    layout = batch.for_every_layer.get("kernel", False)
    if layout is False:
        ours = q.dtype in KERNEL_DTYPES and kernels.available()
        exact = q.dtype != torch.float32
        verifying = [view for view in batch.sequences if exact or not view.prompt] if ours else []
        layout = batch.for_every_layer["kernel"] = KernelLayout(verifying, cache) if verifying else None
    prompts = [view for view in batch.sequences if layout is None or (view.prompt and q.dtype == torch.float32)]
    if not prompts:  # a verification pass: one call
        return _kernel(q, layout, cache, layer).view(q.shape[0], -1)
    outputs = [_attend_sequence(q, view, cache, layer) for view in prompts]
    if layout is None and len(outputs) == len(batch.sequences):
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    out[layout.rows] = _kernel(q.index_select(0, layout.rows), layout, cache, layer).view(len(layout.rows), -1)
    for view, output in zip(prompts, outputs):
        out[view.rows] = output
    return out


def _kernel(q: torch.Tensor, layout: KernelLayout, cache: KVCache, layer: int) -> torch.Tensor:
    return torch.ops.specserve.paged_attention(
        q.contiguous(), cache.keys[layer], cache.values[layer], layout.positions, layout.starts, layout.counts,
        layout.sequences, layout.references, layout.shared, q.shape[-1] ** -0.5)


def _attend_sequence(q: torch.Tensor, view: SequenceView, cache: KVCache, layer: int) -> torch.Tensor:
    """One sequence's packed queries [n, heads, d] against its cached positions -> [n, heads * d]
    through torch's kernel: over a view of a single run, PROMPT_ROWS rows a call, each against the
    positions its rows see; a fragmented sequence in parts (each long run in place, the short runs
    gathered into one), merged by the log-sum-exp the kernel returns."""
    if len(view.runs) > 1:
        query = q[view.rows].transpose(0, 1).unsqueeze(0)
        return _attend_parts(query, view, cache, layer)[0].transpose(0, 1).reshape(query.shape[2], -1)
    start = view.runs[0][1]
    outputs = []
    for rows, seen, mask in _row_slices(view):
        query = q[rows].transpose(0, 1).unsqueeze(0)
        keys, values = cache.keys[layer][:, start:start + seen][None], cache.values[layer][:, start:start + seen][None]
        if query.dtype in (torch.bfloat16, torch.float16):
            attended = _attend_folded(query, keys, values, mask)
        else:
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=None if mask is None else mask[None, None],
                                                      enable_gqa=query.shape[1] != keys.shape[1])
        outputs.append(attended[0].transpose(0, 1).reshape(query.shape[2], -1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _row_slices(view: SequenceView) -> list[tuple[slice, int, torch.Tensor | None]]:
    """The sequence's rows PROMPT_ROWS at a time: packed rows, how many leading positions they see,
    and their mask over those (None: all). Built once a pass (every layer uses it)."""
    if "slices" in view.for_every_layer:
        return view.for_every_layer["slices"]
    slices = []
    for first in range(view.rows.start, view.rows.stop, PROMPT_ROWS):
        last = min(first + PROMPT_ROWS, view.rows.stop)
        mask = None if view.mask is None else view.mask[first - view.rows.start: last - view.rows.start]
        seen = view.end if mask is None else int(mask.any(0).nonzero().max()) + 1
        if mask is not None:
            mask = None if bool(mask[:, :seen].all()) else mask[:, :seen]
        slices.append((slice(first, last), seen, mask))
    view.for_every_layer["slices"] = slices
    return slices


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
