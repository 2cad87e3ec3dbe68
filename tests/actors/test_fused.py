"""Stacked q/k/v and gate/up products: the same logits as separate ones, never stale weights."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.model import kernels, projection
from actors.model.fused import stack_in_place, stacked_view
from actors.model.llama import LlamaDecoder, decoder_from_tensors
from actors.model.loader import load_model, load_tensors
from actors.model.precision import cpu_has_bfloat16
from actors.model.projection import project
from actors.model.runner import ModelRunner
from speculators.proposers.base import TreeInput
from speculators.tree import chain_parents
from tests.conftest import tiny_pair


def logits(model, ids):
    runner = ModelRunner(model, 1, 64)
    runner.add("s")
    return runner.forward([TreeInput("s", ids, chain_parents(len(ids)))])[0]


def test_stacking_makes_views_of_one_tensor_once():
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(2, 4), "c": torch.randn(1, 4)}
    original = {name: t.clone() for name, t in tensors.items()}
    assert stacked_view(list(tensors.values())) is None
    stack_in_place(tensors, ["a", "b", "c"])
    stacked = stacked_view([tensors["a"], tensors["b"], tensors["c"]])
    torch.testing.assert_close(stacked, torch.cat(list(original.values())))
    before = tensors["a"].data_ptr()
    stack_in_place(tensors, ["a", "b", "c"])  # already stacked: no copy
    assert tensors["a"].data_ptr() == before
    assert stacked_view([tensors["b"], tensors["a"]]) is None  # out of order is not a stack


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qkv-bias"])
def test_a_loaded_decoder_runs_stacked_products_with_the_same_logits(qkv_bias):
    separate, _ = tiny_pair()
    if qkv_bias:  # Qwen2's layout: q/k/v biases, stacked like the weights
        state = {n: p.clone() for n, p in separate.named_parameters()}
        separate = LlamaDecoder(dataclasses.replace(separate.config, qkv_bias=True)).to(torch.float64)
        state |= {n: torch.randn_like(p) for n, p in separate.named_parameters() if n.endswith("bias")}
        separate.load_state_dict(state)
    loaded = decoder_from_tensors(separate.config, {n: p.clone() for n, p in separate.named_parameters()})
    layer = loaded.model.layers[0]
    assert layer.self_attn.qkv._weights() is not None and layer.mlp.gate_up._weights() is not None
    assert (layer.self_attn.qkv._weights()[1] is not None) == qkv_bias
    assert separate.model.layers[0].self_attn.qkv._weights() is None  # built without the loader
    ids = list(range(3, 20))
    torch.testing.assert_close(logits(loaded, ids), logits(separate, ids))


def test_weights_assigned_after_loading_are_the_ones_used():
    separate, _ = tiny_pair()
    loaded = decoder_from_tensors(separate.config, {n: p.clone() for n, p in separate.named_parameters()})
    ids = list(range(3, 20))
    before = logits(loaded, ids)
    changed = {n: p.clone() * (1.5 if n.endswith(("k_proj.weight", "up_proj.weight")) else 1.0)
               for n, p in loaded.named_parameters()}
    loaded.load_state_dict(changed, assign=True)
    reference = decoder_from_tensors(separate.config, {n: t.clone() for n, t in changed.items()})
    after = logits(loaded, ids)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, logits(reference, ids))


@pytest.mark.parametrize("path", ["pairs", "ours", "onednn", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_products_equal_a_float64_product_at_every_row_count_and_follow_an_in_place_change(dtype, path, monkeypatch):
    """`project` takes a different path by row count and dtype (our kernel over a paired or a plain
    weight, a packed oneDNN weight, or W @ x.T, or torch's own product where this CPU's oneDNN
    cannot pack the dtype); every one is the same product, and a weight changed in place is packed
    again."""
    if path == "pairs" and (dtype != torch.bfloat16 or not projection.pairs_kernel()):
        pytest.skip("the paired kernel takes bfloat16, built for a CPU with AVX512-BF16")
    if path != "pairs":
        monkeypatch.setattr(projection, "pairs_kernel", lambda: False)
    if path == "ours" and not kernels.available():
        pytest.skip("our kernel is not built here")
    if path == "ours" and dtype == torch.bfloat16 and dtype not in projection.onednn_dtypes():
        pytest.skip("bfloat16 takes our kernel where oneDNN packs it but does not keep a row's bits")
    if path == "onednn" and dtype not in projection.onednn_dtypes():
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    monkeypatch.setattr(projection, "keeps_rows", lambda *_: path != "ours")
    if path != "ours":
        monkeypatch.setattr(projection, "OWN_KERNEL_ROWS", 0)
    if path == "torch":
        monkeypatch.setattr(projection, "onednn_dtypes", lambda: ())
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for rows in (1, 2, 3, 5, 16, 40):
        x = torch.randn(rows, 64, generator=generator).to(dtype)
        exact = x.double() @ weight.double().t()
        assert (project(x, weight).double() - exact).abs().max() < tolerance * exact.abs().max()
    x = torch.randn(16, 64, generator=generator).to(dtype)
    weight.mul_(-1)
    exact = x.double() @ weight.double().t()
    assert (project(x, weight).double() - exact).abs().max() < tolerance * exact.abs().max()


@pytest.mark.default_model
@pytest.mark.skipif(not cpu_has_bfloat16(), reason="no native bfloat16 on this CPU (the products differ there)")
@pytest.mark.parametrize("threads", [1, None], ids=["one-thread", "every-thread"])
def test_a_bfloat16_cpu_product_gives_a_row_the_same_bits_whatever_rows_share_its_pass(default_model_path, threads):
    """What bfloat16 verification needs to equal plain decoding (docs/lossless.md): a row's product
    is bitwise the one it gets alone, at any row count of the pass and at the thread counts the
    engine moves between. The default target's products, whose down projection oneDNN gives other
    bits at 160-256 rows on two threads and from 193 on one (so `project` splits those calls)."""
    names = ["model.layers.5.mlp.down_proj.weight", "model.layers.5.mlp.gate_proj.weight", "model.embed_tokens.weight"]
    tensors = load_tensors(default_model_path, names, torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    most = torch.get_num_threads()
    torch.set_num_threads(threads or most)
    try:
        for name in names:
            weight = tensors[name].contiguous()
            rows = torch.randn(2048, weight.shape[1], generator=generator).to(torch.bfloat16)
            watched = [*range(24), *range(100, 2048, 97)]
            alone = {i: project(rows[i:i + 1], weight) for i in watched}
            for count in [*range(2, 40, 3), 64, 128, 129, 160, 193, 208, 256, 300, 512, 1024, 2048]:
                if weight.shape[0] > 10_000 and count > 512:  # the LM head sees a pass's logit rows only
                    continue
                product = project(rows[:count], weight)
                for i in (i for i in watched if i < count):
                    assert torch.equal(product[i:i + 1], alone[i]), (name, count, i)
    finally:
        torch.set_num_threads(most)


@pytest.mark.skipif(not kernels.available(), reason="our CPU kernels are not built here")
@pytest.mark.parametrize("threads", [1, None], ids=["one-thread", "every-thread"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_cpu_product_gives_a_row_the_same_bits_whatever_rows_share_its_call(dtype, threads):
    """Our kernel sums each output the same way at any row count, split and thread count, so a
    decoding or verification pass gives a row the bits it gets alone; with a bias, and with inputs
    that are no whole number of a step's lanes (8 or 16 floats, 32 bfloat16 pairs). The default
    target's shapes, random weights; calls up to 200 rows (bfloat16 takes it at any count where
    oneDNN does not keep a row's bits)."""
    generator = torch.Generator().manual_seed(2)
    most = torch.get_num_threads()
    torch.set_num_threads(threads or most)
    try:
        for outputs, inputs, bias in [(960, 576, False), (576, 1536, False), (49152, 576, False), (70, 45, True)]:
            weight = torch.randn(outputs, inputs, generator=generator).to(dtype)
            b = torch.randn(outputs, generator=generator).to(dtype) if bias else None
            rows = torch.randn(200, inputs, generator=generator).to(dtype)
            alone = torch.cat([torch.ops.specserve.linear(rows[i:i + 1], weight, b) for i in range(len(rows))])
            exact = rows.double() @ weight.double().t() + (0 if b is None else b.double())
            tolerance = 1e-4 if dtype == torch.float32 else 1e-2
            assert (alone.double() - exact).abs().max() < tolerance * exact.abs().max()
            for count in (2, 3, 4, 5, 7, 16, 33, 64, 129, 200):
                assert torch.equal(torch.ops.specserve.linear(rows[:count], weight, b), alone[:count]), (outputs, inputs, count)
            assert torch.equal(torch.ops.specserve.linear(rows[::2], weight, b), alone[::2])  # rows apart in memory
    finally:
        torch.set_num_threads(most)


@pytest.mark.skipif(not projection.pairs_kernel(), reason="the paired kernel needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("threads", [1, None], ids=["one-thread", "every-thread"])
def test_the_paired_bfloat16_product_gives_a_row_the_same_bits_whatever_rows_share_its_call(threads):
    """Each output is summed over the input pairs in order in lanes of its own, so a row's bits do
    not depend on the call's row count, the thread count or where the rows lie; outputs that are no
    multiple of 16 and a bias included."""
    generator = torch.Generator().manual_seed(4)
    most = torch.get_num_threads()
    torch.set_num_threads(threads or most)
    try:
        for outputs, inputs, bias in [(960, 576, False), (576, 1536, False), (49152, 576, False), (70, 46, True)]:
            weight = torch.randn(outputs, inputs, generator=generator).to(torch.bfloat16)
            b = torch.randn(outputs, generator=generator).to(torch.bfloat16) if bias else None
            rows = torch.randn(300, inputs, generator=generator).to(torch.bfloat16)
            alone = torch.cat([project(rows[i:i + 1], weight, b) for i in range(len(rows))])
            exact = rows.double() @ weight.double().t() + (0 if b is None else b.double())
            assert (alone.double() - exact).abs().max() < 1e-2 * exact.abs().max()
            for count in (2, 3, 4, 5, 7, 16, 33, 64, 65, 129, 300):
                assert torch.equal(project(rows[:count], weight, b), alone[:count]), (outputs, inputs, count)
            assert torch.equal(project(rows[::2], weight, b), alone[::2])  # rows apart in memory
    finally:
        torch.set_num_threads(most)


@pytest.mark.skipif(not kernels.available() or torch.bfloat16 not in projection.onednn_dtypes(),
                    reason="needs our kernel and oneDNN's packed bfloat16")
def test_a_bfloat16_shape_whose_onednn_product_moves_a_rows_bits_takes_our_kernel(monkeypatch):
    """What an AVX512-FP16 Xeon's oneDNN did to the down projection (rows of calls of several rows
    got other bits than alone), played by a stand-in: from 7 rows a call gives its 7th row other
    bits. The probe finds it once for the shape, and every call of that shape then takes our kernel,
    which keeps each row's bits; a shape oneDNN keeps stays there."""
    real = projection.ONEDNN_LINEAR

    def moving_the_seventh_row(x, packed, bias):  # of a 96-input weight's calls; a row at a time otherwise
        y = torch.cat([real(x[i:i + 1], packed, bias) for i in range(len(x))])
        if x.shape[0] >= 7 and x.shape[1] == 96:
            y[6] = y[6] * 1.01
        return y

    monkeypatch.setattr(projection, "ONEDNN_LINEAR", moving_the_seventh_row)
    monkeypatch.setattr(projection, "_keeps_rows", {})
    monkeypatch.setattr(projection, "pairs_kernel", lambda: False)  # a CPU without AVX512-BF16
    generator = torch.Generator().manual_seed(3)
    moved = torch.randn(64, 96, generator=generator).to(torch.bfloat16)
    kept = torch.randn(64, 80, generator=generator).to(torch.bfloat16)
    x = torch.randn(300, 96, generator=generator).to(torch.bfloat16)
    assert not projection.keeps_rows(moved, None)
    alone = torch.cat([project(x[i:i + 1], moved) for i in range(len(x))])
    for count in (7, 8, 64, 129, 300):
        assert torch.equal(project(x[:count], moved), alone[:count])
    assert torch.equal(alone, torch.ops.specserve.linear(x, moved, None))
    assert projection.keeps_rows(kept, None)


@pytest.mark.default_model
@pytest.mark.skipif(not kernels.available() or torch.bfloat16 not in projection.onednn_dtypes(),
                    reason="needs our kernel and oneDNN's packed bfloat16")
def test_loading_a_bfloat16_model_probes_every_product_shape_so_its_first_request_does_not(default_model_path,
                                                                                           monkeypatch):
    monkeypatch.setattr(projection, "_keeps_rows", {})
    monkeypatch.setattr(projection, "pairs_kernel", lambda: False)  # a CPU without AVX512-BF16
    model = load_model(default_model_path, dtype=torch.bfloat16)
    probed = {(shape, threads) for _, shape, _, threads in projection._keeps_rows}
    assert probed == {(tuple(weight.shape), torch.get_num_threads()) for weight, _ in model.products()}
    assert len(probed) == 5  # q/k/v stacked, o, gate/up stacked, down, the LM head


@pytest.mark.default_model
@pytest.mark.skipif(not projection.pairs_kernel(), reason="the paired kernel needs a CPU with AVX512-BF16")
def test_loading_a_bfloat16_model_pairs_every_product_weight_and_probes_none(default_model_path, monkeypatch):
    monkeypatch.setattr(projection, "_keeps_rows", {})
    model = load_model(default_model_path, dtype=torch.bfloat16)
    assert projection._keeps_rows == {}
    for weight, _ in model.products():
        assert weight in projection._paired_weights


def test_a_product_that_needs_a_gradient_takes_torch_s_path():
    """Training (`specserve train`) may run the decoder's layers under autograd, which neither our
    kernel nor oneDNN's packed weight has a backward for: there `project` takes F.linear."""
    weight = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(3, 16)
    project(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, x.sum(0).expand(8, 16))


def test_a_large_half_precision_call_is_split_into_counts_found_invariant(monkeypatch):
    """`call_counts` never uses a row count `row_invariant` rejects: the largest accepted count
    that fits, again, then the rest in calls of at most 128 rows."""
    monkeypatch.setattr(projection, "row_invariant", lambda rows, *_: rows not in (256, 2048))
    weight = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert projection.call_counts(100, weight, weight, None) == [100]
    assert projection.call_counts(300, weight, weight, None) == [192, 108]
    assert projection.call_counts(2100, weight, weight, None) == [1024, 1024, 52]
    assert projection.call_counts(160, weight, weight, None) == [128, 32]
