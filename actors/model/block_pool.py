"""Which KV blocks are free, who holds each, and which hold a known prefix (automatic prefix caching).

Pure bookkeeping, no tensors: `KVCache` stores the blocks, `KVCacheManager` keeps each sequence's
block table. Three rules shape it:
- Contiguity. A sequence grows into the block right after its last one when that is free (or, in
  a pool with no free block left, cached but held by nobody), and a sequence starting (or a grown
  one whose neighbour is taken) starts its blocks centred in the largest free gap, leaving room on
  both sides. So most sequences stay a single run of adjacent blocks, which CPU attention reads as
  one view (attention.py).
- Prefix caching. A full block can be registered under a content hash (chained over every token
  before it and a cache scope); a block that no sequence holds any more stays cached, evicted least
  recently used only when no truly free block is left.
- Determinism. Every decision follows from the calls alone (ordered free gaps, an ordered LRU), so
  the ranks of a tensor-parallel group, which receive the same calls in the same order, hold the
  same tables without sending any.
"""
from __future__ import annotations

import re
from collections import OrderedDict


class CacheFullError(RuntimeError):
    """The KV cache has no room for what a call asks (the engine's admission should prevent it)."""


_FREE_RUN = re.compile(rb"\x01+")


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("a KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._holders = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._unheld: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no sequence holds, least recently used first: free space that still answers lookups."""

    @property
    def available(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody holds."""
        return self._num_free + len(self._unheld)

    @property
    def free(self) -> int:
        """Blocks nobody holds and no cached prefix lives in: taking one forgets nothing."""
        return self._num_free

    def allocate(self, after: int | None = None, run: int = 1) -> int:
        """A block for one holder: the one right after `after` when free (in a pool with no free
        block: when nobody holds it, its cached content forgotten), else the first of `run` blocks
        (about to be taken one after another) centred in the largest free gap, else the least
        recently used cached block (its content forgotten)."""
        neighbour = after + 1 if after is not None and after + 1 < self.num_blocks else None
        if neighbour is not None and self._free[neighbour]:
            block = neighbour
        elif neighbour is not None and not self._num_free and neighbour in self._unheld:
            # a full pool: the cached block next door goes rather than the least recently used one
            # elsewhere (written about when that one was, usually), so the sequence stays one run
            return self._take_cached(neighbour)
        elif self._num_free:
            longest = max(map(len, _FREE_RUN.findall(self._free)))  # two passes in C: no Python loop over gaps
            start = self._free.find(b"\x01" * longest)
            block = start + max(0, longest - run) // 2 if start else 0
        elif self._unheld:
            return self._take_cached(next(iter(self._unheld)))
        else:
            raise CacheFullError(f"all {self.num_blocks} KV cache blocks are in use")
        self._free[block] = 0
        self._num_free -= 1
        self._holders[block] = 1
        return block

    def _take_cached(self, block: int) -> int:
        """A cached block nobody holds, its content forgotten, for one holder."""
        del self._unheld[block]
        self.forget(block)
        self._holders[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more holder of a cached block (a sequence reusing a prefix, or a fork)."""
        if self._holders[block] == 0:
            self._unheld.pop(block)
        self._holders[block] += 1

    def release(self, block: int) -> None:
        """One holder less; a block nobody holds is cached (when registered) or free."""
        self._holders[block] -= 1
        if self._holders[block] > 0:
            return
        if block in self._hash_of:
            self._unheld[block] = None
        else:
            self._free[block] = 1
            self._num_free += 1

    def holders(self, block: int) -> int:
        return self._holders[block]

    def lookup(self, key: bytes) -> int | None:
        """The block registered under `key`, held for the caller (None on a miss)."""
        block = self._block_of.get(key)
        if block is None:
            return None
        self.hold(block)
        return block

    def register(self, block: int, key: bytes) -> None:
        """Make a full block findable by `key`; a key already registered keeps its first block."""
        if key not in self._block_of and block not in self._hash_of:
            self._block_of[key], self._hash_of[block] = block, key

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of

    def forget(self, block: int) -> None:
        """Unregister a block (it is about to be rewritten, or evicted)."""
        key = self._hash_of.pop(block, None)
        if key is None:
            return
        del self._block_of[key]
        if block in self._unheld:
            del self._unheld[block]
            self._free[block] = 1
            self._num_free += 1
