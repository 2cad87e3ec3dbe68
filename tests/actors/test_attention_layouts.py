"""The sdpa backend's two layouts of a packed batch (per sequence over views of its blocks, padded
into one call) attend identically: the CPU takes the first, a GPU the second. A sequence whose
blocks are not adjacent takes the per-run path (log-sum-exp merge), which must agree too."""
from __future__ import annotations

import torch

from actors.model.attention import SdpaBackend
from actors.model.batch import PackedBatch, Segment
from actors.model.kv_cache import KVCache


def test_per_sequence_and_padded_attention_agree():
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 4, 2, 8
    cache = KVCache(1, 16, 4, 32, kv_heads, head_dim, dtype=torch.float64)
    cache.keys.normal_()
    cache.values.normal_()
    tree = torch.ones(3, 12 + 3, dtype=torch.bool)
    tree[1, 12] = tree[2, 13] = False  # two siblings under the first new token
    tree[0, 13:] = False
    segments = [
        Segment([3, 4, 5], 9, 1),  # one run of adjacent blocks: one view
        Segment([0, 7, 8, 1], 12, 3, tree, prefix=12),  # three runs, the tree in the last
        Segment([9, 10, 2, 11, 12, 6, 13], 20, 5, torch.ones(5, 25, dtype=torch.bool).tril(20), prefix=6),
    ]
    assert [len(cache.runs(s.blocks, s.end)) for s in segments] == [1, 3, 5]
    q = torch.randn(sum(s.num_tokens for s in segments), heads, head_dim, dtype=torch.float64)
    per_sequence = PackedBatch(segments, torch.device("cpu"), cache)
    padded = PackedBatch(segments, torch.device("cpu"), cache)
    padded.per_sequence = False
    assert per_sequence.per_sequence
    backend = SdpaBackend()
    got, want = backend.attend(q, per_sequence, cache, 0), backend.attend(q, padded, cache, 0)
    assert got.shape == (q.shape[0], heads * head_dim)
    torch.testing.assert_close(got, want)
    # and the first sequence's single token attends all 10 of its positions, nothing of another sequence
    keys = cache.keys[0, :, 12:22].repeat_interleave(2, 0)
    values = cache.values[0, :, 12:22].repeat_interleave(2, 0)
    weights = torch.softmax(torch.einsum("hd,hnd->hn", q[0], keys) * head_dim ** -0.5, -1)
    torch.testing.assert_close(got[0], torch.einsum("hn,hnd->hd", weights, values).reshape(-1))
