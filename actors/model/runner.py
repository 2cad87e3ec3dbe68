"""ModelRunner: a LlamaDecoder plus a paged KV cache, driven one batch of token trees at a time.

Implements speculators' TreeModel. Per sequence it tracks the block table, the committed length
and the scratch tree (tokens written past it since the last commit), builds each new token's
position (committed length + depth) and attention mask (committed prefix + its scratch ancestors),
and packs every sequence of a call into one forward pass.

Blocks follow use: a call takes the blocks its new tokens need, a commit gives back those past the
committed length (rejected tree nodes cost nothing afterwards) unless they are reserved for a
prompt still being prefilled. With `prefix_caching`, each full committed block is registered under
a hash chained over its tokens, its prefix and the sequence's cache scope, so a later sequence with
the same prefix in the same scope (`reuse_prefix`) holds the same blocks instead of computing them. A block a sequence still writes (at or past its
committed length) is never shared: shared blocks are full, and rolling back into one copies it first.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from actors.model.block_pool import BlockPool
from actors.model.kv_cache import DEFAULT_BLOCK_SIZE, CacheFullError, KVCache
from actors.model.batch import Segment
from actors.model.cuda_graphs import GraphedForward
from actors.model.llama import LlamaDecoder
from actors.model.threads import follow_load
from speculators.proposers.base import TreeInput
from speculators.tree import extend_ancestors


@dataclass
class _SequenceState:
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
    scratch_tokens: list[int] = field(default_factory=list)
    scratch_parents: list[int] = field(default_factory=list)
    scratch_depths: list[int] = field(default_factory=list)
    scratch_mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))


class ModelRunner:
    def __init__(self, model: LlamaDecoder, max_sequences: int, max_len: int, cuda_graphs: bool = False, *,
                 kv_blocks: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE, prefix_caching: bool = False):
        """`kv_blocks` blocks of `block_size` positions (default: room for `max_sequences` sequences
        of `max_len`); a sequence holds at most `max_len` positions. `cuda_graphs`: replay captured
        graphs for one-sequence passes on a GPU (cuda_graphs.py); ignored on a CPU."""
        self.model = model
        self.vocab_size = model.config.vocab_size
        blocks = kv_blocks if kv_blocks is not None else -(-max_sequences * max_len // block_size)
        self.cache: KVCache = model.new_cache(blocks, max_len, block_size)
        self.prefix_caching = prefix_caching
        self._sequences: dict[str, _SequenceState] = {}
        self._pass = GraphedForward(model, self.cache) if cuda_graphs and model.device.type == "cuda" else model

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def pool(self) -> BlockPool:
        return self.cache.pool

    @property
    def available_blocks(self) -> int:
        return self.pool.available

    @property
    def graphed_sizes(self) -> list[int]:
        """New-token counts whose one-sequence passes replay a CUDA graph (none when off)."""
        return sorted(self._pass.buckets) if isinstance(self._pass, GraphedForward) else []

    def add(self, seq_id: str, cache_scope: str | None = None) -> None:
        """A new, empty sequence. Its full blocks are registered for reuse under `cache_scope` when
        the runner caches prefixes (None: under a scope of its own, found only by itself)."""
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        scope = ("request\0" + seq_id) if cache_scope is None else ("scope\0" + cache_scope)
        digest = hashlib.blake2b(scope.encode(errors="replace"), digest_size=16).digest()
        self._sequences[seq_id] = _SequenceState(digest if self.prefix_caching else None)

    def remove(self, seq_id: str) -> None:
        state = self._sequences.pop(seq_id, None)
        if state is not None:
            self._release_from(state, 0)

    def reuse_prefix(self, seq_id: str, tokens: Sequence[int]) -> int:
        """Give the sequence the cached blocks of `tokens` past its committed length, while whole
        blocks of them are registered in its scope; returns how many tokens it gained.

        On an empty sequence (admission) that is the longest cached prefix. On one whose prompt is
        still being prefilled it is what other sequences have filled since: a prompt admitted beside
        another with the same prefix takes the blocks the other computed instead of computing them
        again. Its own blocks there are reserved and not yet written, and are given back."""
        state = self._sequences[seq_id]
        if state.scratch_parents:
            raise ValueError(f"sequence {seq_id!r} has uncommitted tokens")
        size = self.cache.block_size
        if state.length != len(state.keys) * size:
            return 0
        before = state.length
        for key in self._keys_past(state, tokens, len(tokens)):
            block = self.pool.lookup(key)
            if block is None:
                break
            index, start = len(state.keys), state.length
            if index < len(state.blocks):
                self.pool.release(state.blocks[index])
                state.blocks[index] = block
            else:
                state.blocks.append(block)
            state.keys.append(key)
            state.tokens.extend(tokens[start: start + size])
            state.length += size
        return state.length - before

    def block_keys(self, seq_id: str, tokens: Sequence[int], end: int) -> list[bytes]:
        """The keys its next blocks will be registered under once `tokens` (its whole sequence, the
        prompt say) are committed up to position `end`: whole blocks past those it has registered;
        none when it caches nothing."""
        return self._keys_past(self._sequences[seq_id], tokens, end)

    def _keys_past(self, state: _SequenceState, tokens: Sequence[int], end: int) -> list[bytes]:
        if state.scope is None:
            return []
        size, keys = self.cache.block_size, []
        parent = state.keys[-1] if state.keys else state.scope
        for index in range(len(state.keys), min(end, len(tokens)) // size):
            parent = _block_key(parent, tokens[index * size: (index + 1) * size])
            keys.append(parent)
        return keys

    def block_tables(self) -> dict[str, list[int]]:
        """Every sequence's blocks, in order (what the ranks of a group must agree on)."""
        return {seq_id: list(state.blocks) for seq_id, state in self._sequences.items()}

    def has(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    def committed_length(self, seq_id: str) -> int:
        return self._sequences[seq_id].length

    def blocks_to_grow(self, seq_id: str, new_tokens: int) -> int:
        """Blocks a call writing `new_tokens` more tokens to the sequence would take."""
        state = self._sequences[seq_id]
        return max(0, self.cache.blocks_for(state.length + len(state.scratch_parents) + new_tokens) - len(state.blocks))

    def scratch_size(self, seq_id: str) -> int:
        return len(self._sequences[seq_id].scratch_parents)

    @staticmethod
    def _extend_scratch(state: _SequenceState, parents: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """Append new nodes to the scratch tree; return their mask rows over the scratch and depths."""
        old = len(state.scratch_parents)
        state.scratch_mask, state.scratch_depths = extend_ancestors(state.scratch_mask, state.scratch_depths, parents)
        state.scratch_parents = state.scratch_parents + list(parents)
        return state.scratch_mask[old:], state.scratch_depths[old:]

    def forward(self, inputs: Sequence[TreeInput]) -> list[torch.Tensor | None]:
        return self.forward_capturing(inputs)[0]

    def forward_capturing(
        self, inputs: Sequence[TreeInput], capture: Sequence[int] = ()
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """`forward`, plus each input's captured hidden states ([its tokens, len(capture) x hidden],
        see `LlamaDecoder.forward_capturing`; None for inputs without tokens or when nothing is captured)."""
        follow_load(self.model.device)
        needed = 0
        for item in inputs:  # refuse the whole call before any sequence's scratch changes
            state = self._sequences[item.seq_id]
            if len(item.parents) != len(item.token_ids):
                raise ValueError(f"{item.seq_id!r}: {len(item.token_ids)} tokens but {len(item.parents)} parents")
            end = state.length + len(state.scratch_parents) + len(item.token_ids)
            self.cache.check_room(end)
            needed += max(0, self.cache.blocks_for(end) - len(state.blocks))
        if needed > self.pool.available:
            raise CacheFullError(f"the call needs {needed} more KV cache blocks; {self.pool.available} are free")
        ids, positions, segments, rows, spans, token_spans = [], [], [], [], [], []
        offset = 0
        for item in inputs:
            state = self._sequences[item.seq_id]
            count = len(item.token_ids)
            token_spans.append((offset, offset + count) if count else None)
            if count == 0:
                spans.append(None)
                continue
            start = state.length + len(state.scratch_parents)
            self._grow(state, start + count)
            state.scratch_tokens = state.scratch_tokens + list(item.token_ids)
            scratch_rows, depths = self._extend_scratch(state, item.parents)
            ids.extend(item.token_ids)
            positions.extend(state.length + d for d in depths)
            mask = None
            if not bool(scratch_rows.all()):
                prefix = torch.ones(count, state.length, dtype=torch.bool)
                mask = torch.cat([prefix, scratch_rows], dim=1).to(self.model.device)
            segments.append(Segment(list(state.blocks), start, count, mask, prefix=state.length))
            wanted = {"all": range(offset, offset + count), "argmax": range(offset, offset + count),
                      "last": [offset + count - 1]}.get(item.logits, [])
            spans.append((len(rows), len(rows) + len(wanted)) if wanted else None)
            rows.extend(wanted)
            offset += count
        if not segments:
            return [None] * len(inputs), [None] * len(inputs)
        device = self.model.device
        args = (torch.tensor(ids, device=device), torch.tensor(positions, device=device), segments, self.cache,
                torch.tensor(rows, device=device) if rows else None)
        if capture:  # CUDA graphs replay logits rows only; capturing passes run eagerly
            hidden, captured = self.model.forward_capturing(*args, capture)
        else:
            hidden, captured = self._pass(*args), None
        return (self._outputs(hidden, spans, [item.logits for item in inputs]),
                [None if span is None or captured is None else captured[span[0]:span[1]] for span in token_spans])

    def _outputs(self, hidden: torch.Tensor | None, spans: list[tuple[int, int] | None],
                 kinds: list[str]) -> list[torch.Tensor | None]:
        """Each input's rows of `hidden` as logits, or as argmax tokens: one LM-head product per kind."""
        outputs: list[torch.Tensor | None] = [None] * len(spans)
        for argmax, compute in ((True, self.model.likeliest), (False, lambda h: self.model.logits(h).float())):
            chosen = [i for i, span in enumerate(spans) if span is not None and (kinds[i] == "argmax") is argmax]
            if not chosen:
                continue
            rows = torch.cat([torch.arange(*spans[i]) for i in chosen]).to(hidden.device)
            computed, offset = compute(hidden.index_select(0, rows)), 0
            for i in chosen:
                count = spans[i][1] - spans[i][0]
                outputs[i], offset = computed[offset:offset + count], offset + count
        return outputs

    def commit(self, seq_id: str, scratch_nodes: Sequence[int]) -> None:
        state = self._sequences[seq_id]
        nodes = list(scratch_nodes)
        for depth, node in enumerate(nodes):
            if not 0 <= node < len(state.scratch_parents) or state.scratch_depths[node] != depth:
                raise ValueError(f"scratch nodes {nodes} are not a path from the committed context")
            if depth and state.scratch_parents[node] != nodes[depth - 1]:
                raise ValueError(f"scratch nodes {nodes} are not a path from the committed context")
        self.cache.compact(state.blocks, state.length, nodes)
        if state.scope is not None:
            state.tokens.extend(state.scratch_tokens[node] for node in nodes)
        state.length += len(nodes)
        self._clear_scratch(state)
        self._release_from(state, self.cache.blocks_for(max(state.length, state.reserved)))
        self._register_full_blocks(state)

    def reserve(self, seq_id: str, positions: int) -> None:
        """Take the blocks of the sequence's first `positions` positions now and keep them until they
        are committed (a prompt prefilled over several passes)."""
        state = self._sequences[seq_id]
        self._grow(state, positions)
        state.reserved = positions

    def truncate(self, seq_id: str, length: int) -> None:
        state = self._sequences[seq_id]
        if not 0 <= length <= state.length:
            raise ValueError(f"cannot roll {seq_id!r} back from {state.length} to {length} tokens")
        size = self.cache.block_size
        state.length, state.reserved = length, 0
        del state.tokens[length:], state.keys[length // size:]
        self._clear_scratch(state)
        self._release_from(state, self.cache.blocks_for(length))
        last = length // size
        if length % size and (self.pool.holders(state.blocks[last]) > 1 or self.pool.is_registered(state.blocks[last])):
            self._copy_on_write(state, last)

    def _grow(self, state: _SequenceState, end: int) -> None:
        """Blocks for positions up to `end`, each next to the one before when it is free."""
        wanted = self.cache.blocks_for(end) - len(state.blocks)
        for taken in range(wanted):
            state.blocks.append(self.pool.allocate(state.blocks[-1] if state.blocks else None, wanted - taken))

    def _release_from(self, state: _SequenceState, keep: int) -> None:
        """Give back the sequence's blocks past the first `keep`."""
        for block in state.blocks[keep:]:
            self.pool.release(block)
        del state.blocks[keep:]

    def _copy_on_write(self, state: _SequenceState, index: int) -> None:
        """Replace a shared or registered block the sequence is about to write with its own copy."""
        old = state.blocks[index]
        state.blocks[index] = self.pool.allocate(state.blocks[index - 1] if index else None)
        self.cache.copy_block(old, state.blocks[index])
        self.pool.release(old)

    def _register_full_blocks(self, state: _SequenceState) -> None:
        """Register the blocks its committed tokens fill, past those already registered: only what
        is computed is ever found (a block registered before it is filled could be found by a
        sequence that outlives its writer)."""
        for key in self._keys_past(state, state.tokens, state.length):
            self.pool.register(state.blocks[len(state.keys)], key)
            state.keys.append(key)

    @staticmethod
    def _clear_scratch(state: _SequenceState) -> None:
        state.scratch_parents, state.scratch_depths, state.scratch_tokens = [], [], []
        state.scratch_mask = torch.zeros(0, 0, dtype=torch.bool)


def _block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's identity: its tokens and everything before them (the parent's key, which
    starts from the cache scope's digest). 16-byte digests, so that equal keys mean equal prefixes."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b",".join(str(t).encode() for t in tokens))
    return digest.digest()


__all__ = ["ModelRunner", "CacheFullError"]
