"""The `split` attention backend: a tree's attention as two parts merged by log-sum-exp.

Every new token of a sequence attends its whole committed prefix (no mask needed there) plus the
tree block: the positions written since the last commit, under the tree's ancestor mask. The prefix
is the long, regular part, which a KV-cache kernel does best (vllm_flash_attn's varlen kernel,
when it imports on CUDA); the tree block is small and masked. Each part gives an output o and the
log-sum-exp of its scores, and

    o = (e^(lse1 - m) o1 + e^(lse2 - m) o2) / (e^(lse1 - m) + e^(lse2 - m)),  m = max(lse1, lse2)

is exactly attention over both. Without vllm_flash_attn (and on the CPU, where the suite checks the
merge against plain masked attention) the prefix runs through `attention_with_lse` in torch.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from actors.model.batch import gather

if TYPE_CHECKING:
    from actors.model.batch import PackedBatch
    from actors.model.kv_cache import KVCache

NEG_INF = float("-inf")


def attention_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention and its log-sum-exp, in float32 at least (bf16 scores would round the lse).

    query [B, heads, n, d]; keys/values [B, kv_heads, S, d]; mask [B, n, S] (True = may attend).
    Returns out [B, heads, n, d] and lse [B, heads, n]; a row with nothing to attend gets out 0 and
    lse -inf, so that the merge gives it no weight.
    """
    dtype = accumulation_dtype(query)
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1).to(dtype), values.repeat_interleave(groups, 1).to(dtype)
    scores = torch.matmul(query.to(dtype), keys.transpose(-1, -2)) * query.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[:, None], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.matmul(weights, values), lse


def accumulation_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs, their own dtype for float32 and float64."""
    return torch.promote_types(tensor.dtype, torch.float32)


def merge_by_lse(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from each set's output and log-sum-exp."""
    top = torch.maximum(lse1, lse2)
    top = torch.where(torch.isfinite(top), top, 0.0)  # both parts empty: weights 0, output 0
    weight1, weight2 = torch.exp(lse1 - top)[..., None], torch.exp(lse2 - top)[..., None]
    total = (weight1 + weight2).clamp_min(torch.finfo(weight1.dtype).tiny)
    return (weight1 * out1 + weight2 * out2) / total


@dataclass
class SplitLayout:
    """Where each sequence's prefix and tree block lie, built once per forward pass."""

    prefix: torch.Tensor  # [B] committed positions every new token attends
    max_prefix: int
    tree_positions: torch.Tensor  # [B, T] cache positions of the tree block (clamped past its end)
    tree_mask: torch.Tensor  # [B, max_new, T]

    @classmethod
    def of(cls, batch: PackedBatch) -> "SplitLayout":
        device = batch.device
        prefix = torch.tensor([s.prefix for s in batch.segments], device=device)
        spans = [s.end - s.prefix for s in batch.segments]
        offsets = torch.arange(max(spans), device=device)
        inside = offsets[None, :] < torch.tensor(spans, device=device)[:, None]
        positions = torch.minimum(prefix[:, None] + offsets[None, :], torch.tensor(batch.max_end - 1, device=device))
        if batch.mask is None:
            mask = inside[:, None, :].expand(len(spans), batch.max_new, -1)
        else:
            columns = positions[:, None, :].expand(-1, batch.max_new, -1)
            mask = batch.mask.gather(2, columns) & inside[:, None, :]
        return cls(prefix=prefix, max_prefix=max(s.prefix for s in batch.segments), tree_positions=positions, tree_mask=mask)


Varlen = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _flash_varlen() -> Varlen | None:
    """vllm_flash_attn's varlen kernel, when the package imports and a GPU is there."""
    if not torch.cuda.is_available():
        return None
    try:
        from vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


FLASH_DTYPES = (torch.float16, torch.bfloat16)


class SplitBackend:
    name = "split"

    def __init__(self, varlen: Varlen | None = None):
        self.varlen = varlen if varlen is not None else _flash_varlen()
        self._last: tuple[PackedBatch | None, SplitLayout | None] = (None, None)

    @property
    def prefix_kernel(self) -> str:
        return "torch" if self.varlen is None else "vllm_flash_attn"

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Refuse, at load, a dtype the flash kernel would refuse at the first pass."""
        if self.varlen is not None and dtype not in FLASH_DTYPES:
            raise ValueError(f"attention_backend 'split' runs vllm_flash_attn's kernel here, which takes float16 or "
                             f"bfloat16, not {str(dtype).removeprefix('torch.')}: use dtype bfloat16, or attention_backend sdpa")

    def _layout(self, batch: PackedBatch) -> SplitLayout:
        """Every layer of a pass shares one layout; the last one built is kept for the next layer."""
        if self._last[0] is not batch:
            self._last = (batch, SplitLayout.of(batch))
        return self._last[1]

    def attend(self, q: torch.Tensor, batch: PackedBatch, cache: KVCache, layer: int) -> torch.Tensor:
        """q [tokens, heads, d] -> [tokens, heads * d], as AttentionBackend.attend."""
        layout = self._layout(batch)
        query = batch.queries(q)
        tree = batch.storage.gather(1, layout.tree_positions)
        keys, values = gather(cache.keys[layer], tree), gather(cache.values[layer], tree)
        out, lse = attention_with_lse(query, keys, values, layout.tree_mask)
        if layout.max_prefix:
            prefix_out, prefix_lse = (self._flash_prefix if self.varlen else self._torch_prefix)(q, batch, cache, layer, layout)
            out = merge_by_lse(prefix_out, prefix_lse, out, lse)
        return batch.outputs(out.to(q.dtype))

    @staticmethod
    def _torch_prefix(q, batch: PackedBatch, cache: KVCache, layer: int, layout: SplitLayout):
        prefix = batch.storage[:, : layout.max_prefix]
        keys, values = gather(cache.keys[layer], prefix), gather(cache.values[layer], prefix)
        visible = torch.arange(layout.max_prefix, device=q.device)[None, :] < layout.prefix[:, None]
        return attention_with_lse(batch.queries(q), keys, values, visible[:, None, :].expand(-1, batch.max_new, -1))

    def _flash_prefix(self, q, batch: PackedBatch, cache: KVCache, layer: int, layout: SplitLayout):
        """The prefix through the varlen kernel: packed queries, each sequence's prefix K/V packed."""
        lengths = [s.prefix for s in batch.segments]
        stored = torch.cat([batch.storage[index, :n] for index, n in enumerate(lengths)])
        cu_q = torch.tensor([0, *itertools.accumulate(s.num_tokens for s in batch.segments)], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=q.device)
        out, lse = self.varlen(
            q=q, k=cache.keys[layer][:, stored].transpose(0, 1), v=cache.values[layer][:, stored].transpose(0, 1),
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=batch.max_new, max_seqlen_k=layout.max_prefix,
            causal=False, return_softmax_lse=True,
        )
        has_prefix = (layout.prefix > 0).repeat_interleave(torch.tensor([s.num_tokens for s in batch.segments], device=q.device))
        dtype = accumulation_dtype(q)
        lse = torch.where(has_prefix[:, None], lse.transpose(0, 1).to(dtype), NEG_INF)  # the kernel marks rows with no keys +inf
        return batch.queries(out).to(dtype), batch.queries(lse.unsqueeze(-1)).squeeze(-1)
