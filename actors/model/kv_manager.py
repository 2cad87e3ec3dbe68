"""KVCacheManager: which KV blocks each sequence holds, over BlockPool.

Per sequence it keeps the block table, the committed length, the chain of hashes of its full
committed blocks and a reservation; ModelRunner asks it for blocks and writes into them.

Blocks follow use: a call takes the blocks its new tokens need, a commit gives back those past the
committed length (rejected tree nodes cost nothing afterwards) unless they are reserved for a
prompt still being prefilled. With `prefix_caching`, each full committed block is registered under
a hash chained over its tokens, its prefix and the sequence's cache scope, so a later sequence with
the same prefix in the same scope (`reuse_prefix`) holds the same blocks instead of computing them.
A block a sequence still writes (at or past its committed length) is never shared: shared blocks
are full, and rolling back into one copies it first.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from actors.model.block_pool import BlockPool
from actors.model.kv_cache import KVCache


@dataclass
class _SequenceBlocks:
    scope: bytes | None
    """Cache scope of its registered blocks (None: it shares none)."""
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    """The committed token ids (kept while prefix caching, to hash full blocks)."""
    keys: list[bytes] = field(default_factory=list)
    """The chained hash of each full committed block so far."""
    reserved: int = 0
    """Positions whose blocks it keeps past its committed length (a prompt still being prefilled)."""


class KVCacheManager:
    def __init__(self, cache: KVCache, prefix_caching: bool = False, keep_runs: bool = False):
        """`keep_runs`: keep each sequence a single run of adjacent blocks, for attention that reads a
        run as one view (a CPU's, attention.py), where a sequence in several runs is attended in parts
        and merged: prefix hits are copied (see `reuse_prefix`) and the pool places blocks for runs
        before cached prefixes (BlockPool.keep_runs)."""
        self.cache = cache
        self.prefix_caching = prefix_caching
        cache.pool.keep_runs = keep_runs
        self._sequences: dict[str, _SequenceBlocks] = {}

    @property
    def pool(self) -> BlockPool:
        return self.cache.pool

    def add(self, seq_id: str, cache_scope: str | None = None) -> None:
        """A new sequence holding no block. Its full blocks are registered for reuse under
        `cache_scope` when prefixes are cached (None: under a scope of its own, found only by itself)."""
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        scope = ("request\0" + seq_id) if cache_scope is None else ("scope\0" + cache_scope)
        digest = hashlib.blake2b(scope.encode(errors="replace"), digest_size=16).digest()
        self._sequences[seq_id] = _SequenceBlocks(digest if self.prefix_caching else None)

    def remove(self, seq_id: str) -> None:
        state = self._sequences.pop(seq_id, None)
        if state is not None:
            self._release_from(state, 0)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    def committed_length(self, seq_id: str) -> int:
        return self._sequences[seq_id].length

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's blocks, in order of position."""
        return list(self._sequences[seq_id].blocks)

    def block_tables(self) -> dict[str, list[int]]:
        """Every sequence's blocks, in order (what the ranks of a group must agree on)."""
        return {seq_id: list(state.blocks) for seq_id, state in self._sequences.items()}

    def blocks_to_reach(self, seq_id: str, end: int) -> int:
        """Blocks the sequence would take to hold positions up to `end`."""
        return max(0, self.cache.blocks_for(end) - len(self._sequences[seq_id].blocks))

    def allocate(self, seq_id: str, end: int) -> None:
        """Blocks for positions up to `end`, each next to the one before when it is free."""
        state = self._sequences[seq_id]
        wanted = self.cache.blocks_for(end) - len(state.blocks)
        for taken in range(wanted):
            state.blocks.append(self.pool.allocate(state.blocks[-1] if state.blocks else None, wanted - taken))

    def reserve(self, seq_id: str, positions: int) -> None:
        """Take the blocks of the sequence's first `positions` positions now and keep them until they
        are committed (a prompt prefilled over several passes)."""
        self.allocate(seq_id, positions)
        self._sequences[seq_id].reserved = positions

    def reuse_prefix(self, seq_id: str, tokens: Sequence[int], room_to_copy: bool = False) -> int:
        """Give the sequence the cached blocks of `tokens` past its committed length, while whole
        blocks of them are registered in its scope; returns how many tokens it gained.

        On an empty sequence (admission) that is the longest cached prefix. On one whose prompt is
        still being prefilled it is what other sequences have filled since: a prompt admitted beside
        another with the same prefix takes the blocks the other computed instead of computing them
        again. Its own blocks there are reserved and not yet written.

        With `keep_runs` the sequence stays one run of adjacent blocks: a cached block's K/V is copied
        into a block of its own (one it reserved, or, when the caller's fit policy says the pool has
        `room_to_copy` all of `tokens`, a free one next to its last: a copy never evicts a cached
        prefix) instead of being held. Otherwise the cached block is held, and a reserved block it
        replaces is given back."""
        state = self._sequences[seq_id]
        size = self.cache.block_size
        if state.length != len(state.keys) * size:
            return 0
        before, sources, destinations, hits = state.length, [], [], []
        for key in self._keys_past(state, tokens, len(tokens)):
            block = self.pool.lookup(key)  # held, so that no allocation below evicts it before it is copied
            if block is None:
                break
            hits.append((key, block))
        for key, block in hits:
            index, start = len(state.keys), state.length
            owned = index < len(state.blocks)
            if self.pool.keep_runs and (owned or (room_to_copy and self.pool.free)):
                if not owned:
                    left = self.cache.blocks_for(len(tokens)) - len(state.blocks)
                    state.blocks.append(self.pool.allocate(state.blocks[-1] if state.blocks else None, left))
                sources.append(block)
                destinations.append(state.blocks[index])
            elif owned:
                self.pool.release(state.blocks[index])
                state.blocks[index] = block
            else:
                state.blocks.append(block)
            state.keys.append(key)
            state.tokens.extend(tokens[start: start + size])
            state.length += size
        self.cache.copy_blocks(sources, destinations)
        for block in sources:
            self.pool.release(block)
        return state.length - before

    def block_keys(self, seq_id: str, tokens: Sequence[int], end: int) -> list[bytes]:
        """The keys its next blocks will be registered under once `tokens` (its whole sequence, the
        prompt say) are committed up to position `end`: whole blocks past those it has registered;
        none when it caches nothing."""
        return self._keys_past(self._sequences[seq_id], tokens, end)

    def commit(self, seq_id: str, tokens: Sequence[int]) -> None:
        """`tokens` follow the committed ones (their K/V already in place): the blocks past them go
        back unless reserved, and the blocks they fill are registered."""
        state = self._sequences[seq_id]
        if state.scope is not None:
            state.tokens.extend(tokens)
        state.length += len(tokens)
        self._release_from(state, self.cache.blocks_for(max(state.length, state.reserved)))
        self._register_full_blocks(state)

    def truncate(self, seq_id: str, length: int) -> None:
        """Keep the first `length` committed positions; the block they end in becomes the
        sequence's own (copied) when it is shared or registered, as the next write goes there."""
        state = self._sequences[seq_id]
        if not 0 <= length <= state.length:
            raise ValueError(f"cannot roll {seq_id!r} back from {state.length} to {length} tokens")
        size = self.cache.block_size
        state.length, state.reserved = length, 0
        del state.tokens[length:], state.keys[length // size:]
        self._release_from(state, self.cache.blocks_for(length))
        last = length // size
        if length % size and (self.pool.holders(state.blocks[last]) > 1 or self.pool.is_registered(state.blocks[last])):
            self._copy_on_write(state, last)

    def _keys_past(self, state: _SequenceBlocks, tokens: Sequence[int], end: int) -> list[bytes]:
        if state.scope is None:
            return []
        size, keys = self.cache.block_size, []
        parent = state.keys[-1] if state.keys else state.scope
        for index in range(len(state.keys), min(end, len(tokens)) // size):
            parent = _block_key(parent, tokens[index * size: (index + 1) * size])
            keys.append(parent)
        return keys

    def _release_from(self, state: _SequenceBlocks, keep: int) -> None:
        """Give back the sequence's blocks past the first `keep`, last first: cached ones are evicted
        in the order they are given back, and a prefix's later blocks are worth less than its first
        (a block is found only after every block before it)."""
        for block in reversed(state.blocks[keep:]):
            self.pool.release(block)
        del state.blocks[keep:]

    def _copy_on_write(self, state: _SequenceBlocks, index: int) -> None:
        """Replace a shared or registered block the sequence is about to write with its own copy."""
        old = state.blocks[index]
        state.blocks[index] = self.pool.allocate(state.blocks[index - 1] if index else None)
        self.cache.copy_blocks([old], [state.blocks[index]])
        self.pool.release(old)

    def _register_full_blocks(self, state: _SequenceBlocks) -> None:
        """Register the blocks its committed tokens fill, past those already registered: only what
        is computed is ever found (a block registered before it is filled could be found by a
        sequence that outlives its writer)."""
        for key in self._keys_past(state, state.tokens, state.length):
            self.pool.register(state.blocks[len(state.keys)], key)
            state.keys.append(key)


def _block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's identity: its tokens and everything before them (the parent's key, which
    starts from the cache scope's digest). 16-byte digests, so that equal keys mean equal prefixes."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b",".join(str(t).encode() for t in tokens))
    return digest.digest()


__all__ = ["KVCacheManager"]
