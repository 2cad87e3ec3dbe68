"""Our CPU attention kernel: a verified token gets exactly the bits of the same token decoded alone."""
from __future__ import annotations

import pytest
import torch

from actors.model import kernels
from actors.model.attention import SdpaBackend
from actors.model.batch import PackedBatch, Segment
from actors.model.kv_cache import KVCache

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler here")

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 64, 16


def attend(cache: KVCache, segments: list[Segment], q: torch.Tensor) -> torch.Tensor:
    return SdpaBackend().attend(q, PackedBatch(segments, torch.device("cpu"), cache), cache, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_node_attends_with_the_bits_of_the_same_token_decoded_alone(dtype):
    """A tree of two branches over 100 committed positions, verified beside a decoding sequence and
    a prompt chunk: each node's output equals, bit for bit, that of a one-row pass whose cache holds
    its ancestors in position order (as plain decoding lays them), whatever the node's scratch column."""
    torch.manual_seed(0)
    committed = 100
    parents = [-1, 0, 1, 2, 1, 4, 5, 0, 7]  # branches 0-1-2-3, 0-1-4-5-6 and 0-7-8
    tree_cache = KVCache(1, 40, BLOCK, 256, KV_HEADS, DIM, dtype=dtype)
    tree_cache.keys.normal_()
    tree_cache.values.normal_()
    mask = torch.ones(len(parents), committed + len(parents), dtype=torch.bool)
    mask[:, committed:] = False
    for node in range(len(parents)):
        ancestor = node
        while ancestor >= 0:
            mask[node, committed + ancestor] = True
            ancestor = parents[ancestor]
    tree_blocks = [3, 4, 5, 6, 7, 8, 9]
    neighbour = Segment([20, 21], 20, 1)
    prompt = Segment([30, 31, 32], 10, 30, torch.ones(30, 40, dtype=torch.bool).tril(10), prefix=10, prompt=True)
    q = torch.randn(1 + len(parents) + 30, HEADS, DIM).to(dtype)
    batch = [neighbour, Segment(tree_blocks, committed, len(parents), mask, prefix=committed), prompt]
    verified = attend(tree_cache, batch, q)
    for node in range(len(parents)):
        path = mask[node, committed:].nonzero().squeeze(1).tolist()  # its ancestors and itself, in position order
        alone = KVCache(1, 40, BLOCK, 256, KV_HEADS, DIM, dtype=dtype)
        alone.keys.copy_(tree_cache.keys)
        alone.values.copy_(tree_cache.values)
        stored = tree_cache.index(tree_blocks, committed + len(parents))
        for depth, column in enumerate(path):
            alone.keys[:, :, stored[committed + depth]] = tree_cache.keys[:, :, stored[committed + column]]
            alone.values[:, :, stored[committed + depth]] = tree_cache.values[:, :, stored[committed + column]]
        row = 1 + node
        decoded = attend(alone, [Segment(tree_blocks, committed + len(path) - 1, 1)], q[row:row + 1].contiguous())
        assert torch.equal(verified[row:row + 1], decoded), f"node {node}"


def test_rows_sharing_a_prefix_give_the_bits_they_get_alone():
    """The kernel loads a block every row of a sequence attends once for all of them; each row's
    arithmetic must stay its own: a chunk's rows equal the same rows attended one per pass."""
    torch.manual_seed(1)
    cache = KVCache(1, 20, BLOCK, 320, KV_HEADS, DIM, dtype=torch.bfloat16)
    cache.keys.normal_()
    cache.values.normal_()
    blocks = list(range(2, 20))
    rows = 70
    together = attend(cache, [Segment(blocks, 200, rows, torch.ones(rows, 200 + rows, dtype=torch.bool).tril(200))],
                      q := torch.randn(rows, HEADS, DIM).to(torch.bfloat16))
    for row in (0, 31, 32, 69):
        alone = attend(cache, [Segment(blocks, 200 + row, 1)], q[row:row + 1].contiguous())
        assert torch.equal(together[row:row + 1], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whether_its_keys_lie_in_adjacent_blocks_or_apart(dtype):
    """The kernel reads keys held at consecutive storage positions where they lie and copies others;
    a row's output cannot depend on which: the same 70 positions in blocks of 8 stored in order
    (16 columns a run) and with each pair of blocks swapped (no run of 16)."""
    torch.manual_seed(2)
    in_order, swapped = list(range(2, 12)), [3, 2, 5, 4, 7, 6, 9, 8, 11, 10]
    caches = {}
    for name, table in (("in order", in_order), ("swapped", swapped)):
        cache = caches[name] = KVCache(1, 16, 8, 128, KV_HEADS, DIM, dtype=dtype)
        stored = cache.index(table, 70)
        generator = torch.Generator().manual_seed(3)
        cache.keys[:, :, stored] = torch.randn(1, KV_HEADS, 70, DIM, generator=generator).to(dtype)
        cache.values[:, :, stored] = torch.randn(1, KV_HEADS, 70, DIM, generator=generator).to(dtype)
    q = torch.randn(1, HEADS, DIM).to(dtype)
    ordered = attend(caches["in order"], [Segment(in_order, 69, 1)], q)
    assert torch.equal(ordered, attend(caches["swapped"], [Segment(swapped, 69, 1)], q))


def test_without_a_compiler_the_kernel_is_unavailable_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "missing" / "specserve_kernels.so")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    kernels.available.cache_clear()
    try:
        assert not kernels.available()
        assert "unavailable" in caplog.text
    finally:
        monkeypatch.undo()
        kernels.available.cache_clear()
    assert kernels.available()  # the real build loads again
