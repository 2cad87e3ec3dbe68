"""Paged K/V storage: every layer's keys and values in one pool of fixed-size blocks.

A sequence's positions live in the blocks its table lists (KVCacheManager keeps the tables, BlockPool
hands out the blocks), so memory follows what sequences use instead of a slot of `max_len` each,
and a full block can be shared by every sequence with the same prefix. Positions are absolute
within a sequence, so rolling back costs nothing (its owner forgets positions) and a tree of new
tokens is written into scratch positions past the committed length; `compact` then moves the
accepted nodes' K/V into place (gpt-fast style).

Layout [layers, kv_heads, blocks x block_size, head_dim]: a run of physically adjacent blocks is one
strided view, which attention on a CPU reads with no copy (attention.py); BlockPool keeps most
sequences a single run.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.model.block_pool import BlockPool, CacheFullError

DEFAULT_BLOCK_SIZE = 16


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {block_size}")
        # one block more than the pool hands out: where a CUDA graph's pad tokens write
        shape = (num_layers, num_kv_heads, (num_blocks + 1) * block_size, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.max_len = block_size, max_len
        self.pool = BlockPool(num_blocks)
        self.pad_position = num_blocks * block_size

    @staticmethod
    def bytes_per_position(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def check_room(self, end: int) -> None:
        if end > self.max_len:
            raise CacheFullError(f"a sequence needs {end} positions; the KV cache holds {self.max_len} per sequence")

    def physical(self, table: Sequence[int], start: int, end: int) -> list[int]:
        """Where logical positions [start, end) of the sequence with block `table` are stored."""
        size = self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def index(self, table: Sequence[int], end: int, length: int | None = None) -> torch.Tensor:
        """Physical positions of logical [0, end) as a tensor, padded to `length` with the pad position."""
        size = self.block_size
        blocks = torch.tensor(list(table[: self.blocks_for(end)]), dtype=torch.long)
        positions = (blocks[:, None] * size + torch.arange(size)).flatten()[:end]
        if length is not None and length > end:
            positions = torch.cat([positions, torch.full((length - end,), self.pad_position, dtype=torch.long)])
        return positions

    def runs(self, table: Sequence[int], end: int) -> list[tuple[int, int, int]]:
        """Logical [0, end) as maximal runs of adjacent storage: (logical start, physical start, length)."""
        size, runs = self.block_size, []
        for index in range(self.blocks_for(end)):
            block = table[index]
            if runs and runs[-1][1] + runs[-1][2] == block * size:
                logical, physical, length = runs[-1]
                runs[-1] = (logical, physical, length + size)
            else:
                runs.append((index * size, block * size, size))
        if runs:
            logical, physical, _ = runs[-1]
            runs[-1] = (logical, physical, end - logical)
        return runs

    def compact(self, table: Sequence[int], start: int, offsets: Sequence[int]) -> None:
        """Move logical positions start + offsets[i] to start + i, in every layer (offsets ascending)."""
        if list(offsets) == list(range(len(offsets))):
            return
        device = self.keys.device
        source = torch.tensor(self.physical(table, start, start + offsets[-1] + 1), device=device)
        source = source.index_select(0, torch.tensor(list(offsets), device=device))
        destination = torch.tensor(self.physical(table, start, start + len(offsets)), device=device)
        for store in (self.keys, self.values):
            store.index_copy_(2, destination, store.index_select(2, source))

    def copy_blocks(self, sources: Sequence[int], destinations: Sequence[int]) -> None:
        """Copy each source block's K/V into its destination block, in every layer (one copy per store)."""
        if not sources:
            return
        device, size = self.keys.device, self.block_size
        source = self.index(sources, len(sources) * size).to(device)
        destination = self.index(destinations, len(destinations) * size).to(device)
        for store in (self.keys, self.values):
            store.index_copy_(2, destination, store.index_select(2, source))


__all__ = ["KVCache", "CacheFullError", "DEFAULT_BLOCK_SIZE"]
