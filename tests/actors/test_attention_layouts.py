"""The sdpa backend's layouts of a packed batch attend identically: on a CPU our kernel for
verification rows and torch's per sequence over views of its blocks for prompts (a sequence whose
blocks are not adjacent in parts merged by log-sum-exp), on a GPU one padded call."""
from __future__ import annotations

import pytest
import torch

from actors.model import kernels
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


def test_long_runs_attend_in_place_and_short_ones_gathered_agree(monkeypatch):
    """Blocks of 4 with LONG_RUN 8: a sequence of two long runs and three short ones takes both kinds
    of part (the long ones in place, the short ones gathered into one) and attends as the padded path does."""
    import actors.model.cpu_attention as attention

    torch.manual_seed(1)
    cache = KVCache(1, 24, 4, 64, 2, 8, dtype=torch.float64)
    cache.keys.normal_()
    cache.values.normal_()
    mask = torch.ones(4, 30, dtype=torch.bool).tril(26)
    segment = Segment([0, 1, 5, 9, 10, 11, 14, 20], 26, 4, mask, prefix=26)
    assert [length for _, _, length in cache.runs(segment.blocks, segment.end)] == [8, 4, 12, 4, 2]
    q = torch.randn(4, 4, 8, dtype=torch.float64)
    padded = PackedBatch([segment], torch.device("cpu"), cache)
    padded.per_sequence = False
    want = SdpaBackend().attend(q, padded, cache, 0)
    monkeypatch.setattr(attention, "LONG_RUN", 8)
    got = SdpaBackend().attend(q, PackedBatch([segment], torch.device("cpu"), cache), cache, 0)
    torch.testing.assert_close(got, want)
    view = PackedBatch([segment], torch.device("cpu"), cache).sequences[0]
    assert [type(storage).__name__ for storage, _ in attention._parts(view, torch.float64, 2)] == ["slice", "slice", "Tensor"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ours", [True, False], ids=["our-kernel", "torch-kernel"])
def test_cpu_paths_attend_as_float64_does(dtype, ours, monkeypatch):
    """Trees, decoding rows, fragmented sequences and prompt chunks (a long one, in several calls)
    in one pass, through our kernel or, where it cannot be built, torch's (bfloat16 folded): as the
    float64 padded path does, to the dtype's precision."""
    if not ours:
        monkeypatch.setattr(kernels, "available", lambda: False)
    elif not kernels.available():
        pytest.skip("no C++ compiler here")
    torch.manual_seed(1)
    heads, kv_heads, head_dim = 6, 2, 16
    exact = KVCache(1, 100, 4, 320, kv_heads, head_dim, dtype=torch.float64)
    exact.keys.normal_()
    exact.values.normal_()
    low = KVCache(1, 100, 4, 320, kv_heads, head_dim, dtype=dtype)
    low.keys.copy_(exact.keys)
    low.values.copy_(exact.values)
    tree = torch.ones(3, 10 + 3, dtype=torch.bool)
    tree[1, 10] = tree[2, 11] = False
    tree[0, 11:] = False
    long_prompt = torch.ones(150, 300, dtype=torch.bool).tril(150)
    segments = [Segment([0, 1, 2], 9, 1), Segment([4, 5, 6, 7], 10, 3, tree, prefix=10),
                Segment([9, 8, 12, 11], 12, 3, torch.ones(3, 15, dtype=torch.bool).tril(12), prefix=12),
                Segment(list(range(20, 95)), 150, 150, long_prompt, prefix=150, prompt=True)]
    q = torch.randn(sum(s.num_tokens for s in segments), heads, head_dim, dtype=torch.float64)
    padded = PackedBatch(segments, torch.device("cpu"), exact)
    padded.per_sequence = False
    want = SdpaBackend().attend(q, padded, exact, 0)
    got = SdpaBackend().attend(q.to(dtype), PackedBatch(segments, torch.device("cpu"), low), low, 0)
    tolerance = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
