"""Which KV blocks are free, who holds each, and which hold a known prefix (automatic prefix caching).

Pure bookkeeping, no tensors: `KVCache` stores the blocks, `KVCacheManager` keeps each sequence's
block table. Three rules shape it:
- Contiguity. A sequence grows into the block right after its last one when that is free, and a
  sequence starting (or a grown one whose neighbour is taken) starts its blocks centred in the
  largest free gap, leaving room on both sides. So most sequences stay a single run of adjacent
  blocks, which CPU attention reads as one view (attention.py). With `keep_runs` (a CPU's cache)
  runs come before cached prefixes: blocks nobody holds count as gap space, cached or not, and a
  sequence grows into the cached block next door, its content forgotten. Without it, a pool with no
  free block left still grows a sequence into the cached block next door rather than into the least
  recently used one elsewhere.
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
    def __init__(self, num_blocks: int, keep_runs: bool = False):
        if num_blocks < 1:
            raise ValueError("a KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.keep_runs = keep_runs
        """Keep sequences single runs at the price of cached prefixes (see the module doc). On a
        long-running CPU server cached blocks lie everywhere, so without it the free gaps shrink to a
        few blocks and every sequence becomes many runs: attention in parts, a merge per part."""
        self._free = bytearray(b"\x01") * num_blocks
        self._open = bytearray(b"\x01") * num_blocks
        """1 where nobody holds the block: free, or cached and unheld."""
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
        """A block for one holder: the one right after `after` when free (when nobody holds it and
        the pool keeps runs or has no free block: its cached content forgotten), else the first of
        `run` blocks (about to be taken one after another) centred in the largest gap (of free
        blocks; of blocks nobody holds when the pool keeps runs and no free gap holds `run`), else
        the least recently used cached block (its content forgotten)."""
        neighbour = after + 1 if after is not None and after + 1 < self.num_blocks else None
        if neighbour is not None and self._free[neighbour]:
            return self._take_free(neighbour)
        if neighbour is not None and neighbour in self._unheld and (self.keep_runs or not self._num_free):
            # the cached block next door goes rather than the least recently used one elsewhere
            # (written about when that one was, usually), so the sequence stays one run
            return self._take_cached(neighbour)
        free_gap = _largest_gap(self._free) if self._num_free else None
        if self.keep_runs and self.available and (free_gap is None or free_gap[1] < run):
            block = _centred(*_largest_gap(self._open), run)
            return self._take_free(block) if self._free[block] else self._take_cached(block)
        if free_gap is not None:
            return self._take_free(_centred(*free_gap, run))
        if self._unheld:
            return self._take_cached(next(iter(self._unheld)))
        raise CacheFullError(f"all {self.num_blocks} KV cache blocks are in use")

    def _take_free(self, block: int) -> int:
        self._free[block] = self._open[block] = 0
        self._num_free -= 1
        self._holders[block] = 1
        return block

    def _take_cached(self, block: int) -> int:
        """A cached block nobody holds, its content forgotten, for one holder."""
        del self._unheld[block]
        self.forget(block)
        self._open[block] = 0
        self._holders[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more holder of a cached block (a sequence reusing a prefix, or a fork)."""
        if self._holders[block] == 0:
            self._unheld.pop(block)
            self._open[block] = 0
        self._holders[block] += 1

    def release(self, block: int) -> None:
        """One holder less; a block nobody holds is cached (when registered) or free."""
        self._holders[block] -= 1
        if self._holders[block] > 0:
            return
        self._open[block] = 1
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


def _largest_gap(marks: bytearray) -> tuple[int, int]:
    """(start, length) of the first longest run of 1s; two passes in C, no Python loop over gaps."""
    length = max(map(len, _FREE_RUN.findall(marks)))
    return marks.find(b"\x01" * length), length


def _centred(start: int, length: int, run: int) -> int:
    """Where `run` blocks start in a gap: centred, leaving room for the sequence before the gap to
    grow into; at the pool's start, where no sequence comes before."""
    return start + max(0, length - run) // 2 if start else 0
