"""Position-indexed K/V storage with one slot per sequence.

Keys and values are stored by absolute position, so rolling a sequence back costs nothing (its
owner just forgets positions) and a tree of new tokens is written into the scratch region past the
committed length; `compact` then moves the accepted nodes' K/V into place (gpt-fast style).
Which positions are committed is the ModelRunner's business, not the storage's.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class CacheFullError(RuntimeError):
    """No free slot, or a sequence would grow past a slot's capacity."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV cache slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    def check_room(self, end: int) -> None:
        if end > self.max_len:
            raise CacheFullError(f"a sequence needs {end} positions; the KV cache holds {self.max_len}")

    def compact(self, slot: int, start: int, offsets: Sequence[int]) -> None:
        """Move positions start + offsets[i] to start + i, in every layer (offsets ascending)."""
        if list(offsets) == list(range(len(offsets))):
            return
        source = torch.tensor(offsets, dtype=torch.long, device=self.keys.device) + start
        end = start + len(offsets)
        for store in (self.keys, self.values):
            store[:, slot, :, start:end] = store[:, slot].index_select(2, source)

    def copy(self, source: int, destination: int, length: int) -> None:
        """Copy the first `length` positions of slot `source` into slot `destination`, in every layer."""
        for store in (self.keys, self.values):
            store[:, destination, :, :length] = store[:, source, :, :length]
