"""The split attention backend: prefix and tree block merged by log-sum-exp equal plain masked attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.model.attention import get_backend
from actors.model.runner import ModelRunner
from actors.model.split_attention import SplitBackend, attention_with_lse, merge_by_lse
from speculators.proposers.base import TreeInput
from speculators.tree import chain_parents


def sdpa(query, keys, values, mask):
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask.unsqueeze(1), enable_gqa=True)


@pytest.mark.parametrize("split_at", [[0, 0], [5, 11], [17, 17]], ids=["no-prefix", "uneven", "all-prefix"])
def test_merging_two_parts_by_lse_is_attention_over_both(split_at):
    torch.manual_seed(0)
    query = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    keys, values = torch.randn(2, 2, 17, 8, dtype=torch.float64), torch.randn(2, 2, 17, 8, dtype=torch.float64)
    mask = torch.rand(2, 6, 17) < 0.6
    mask[:, :, 16] = True  # every row attends something
    columns = torch.arange(17)[None, None, :]
    before = columns < torch.tensor(split_at)[:, None, None]
    out1, lse1 = attention_with_lse(query, keys, values, mask & before)
    out2, lse2 = attention_with_lse(query, keys, values, mask & ~before)
    merged = merge_by_lse(out1, lse1, out2, lse2)
    torch.testing.assert_close(merged, sdpa(query, keys, values, mask))
    _, lse = attention_with_lse(query, keys, values, mask)
    torch.testing.assert_close(torch.logaddexp(lse1, lse2), lse)


def test_a_row_with_nothing_to_attend_gets_no_weight():
    query, keys = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    nothing = torch.zeros(1, 3, 5, dtype=torch.bool)
    out, lse = attention_with_lse(query, keys, keys, nothing)
    assert bool((lse == float("-inf")).all()) and bool((out == 0).all())
    other, other_lse = attention_with_lse(query, keys, keys, ~nothing)
    torch.testing.assert_close(merge_by_lse(out, lse, other, other_lse), other)


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, return_softmax_lse):
    """vllm_flash_attn's flash_attn_varlen_func as documented: packed [total, heads, d] inputs, out
    like q, lse [heads, total_q], and rows with no keys get out 0 and lse +inf."""
    assert not causal and return_softmax_lse
    lse_dtype = torch.promote_types(q.dtype, torch.float32)  # float32 for the kernel's bf16/fp16
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=lse_dtype)
    for b in range(len(cu_seqlens_q) - 1):
        rows, cols = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1]), slice(cu_seqlens_k[b], cu_seqlens_k[b + 1])
        if cols.stop == cols.start:
            continue
        groups = q.shape[1] // k.shape[1]
        keys, values = k[cols].repeat_interleave(groups, 1), v[cols].repeat_interleave(groups, 1)
        scores = torch.einsum("nhd,mhd->hnm", q[rows], keys) * q.shape[-1] ** -0.5
        lse[:, rows] = torch.logsumexp(scores, -1)
        out[rows] = torch.einsum("hnm,mhd->nhd", scores.softmax(-1), values)
    return out, lse


def run_trees(model):
    """Logits of a packed pass over three sequences: one with scratch from an earlier call, one
    fresh tree, one with no committed context; then a single-token step."""
    runner = ModelRunner(model, 3, 64)
    for seq_id, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [7, 8])):
        runner.add(seq_id)
        runner.forward([TreeInput(seq_id, prompt, chain_parents(len(prompt)), logits="none")])
        runner.commit(seq_id, range(len(prompt)))
    runner.add("c")
    runner.forward([TreeInput("a", [9, 10], [-1, -1])])  # scratch the next call builds on
    outputs = runner.forward([
        TreeInput("a", [11, 12, 13], [0, 1, 2]),
        TreeInput("b", [14, 15, 16, 17], [-1, -1, 0, 1]),
        TreeInput("c", [18, 19, 20], chain_parents(3)),
    ])
    runner.commit("b", [0, 2])
    outputs += runner.forward([TreeInput("b", [21], [-1])])
    return torch.cat(outputs)


@pytest.mark.parametrize("varlen", [None, reference_varlen], ids=["torch-prefix", "varlen-prefix"])
def test_the_split_backend_gives_the_logits_of_sdpa(tiny_model, varlen):
    model, _ = tiny_model
    expected = run_trees(model)
    model.backend = SplitBackend(varlen)
    try:
        torch.testing.assert_close(run_trees(model), expected, rtol=1e-9, atol=1e-9)
    finally:
        model.backend = get_backend("sdpa")


def test_backends_are_chosen_by_name():
    assert get_backend("split").prefix_kernel in ("torch", "vllm_flash_attn")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash-attn-3")


def test_split_with_the_flash_kernel_refuses_float32_at_load(tiny_model, monkeypatch):
    """vllm_flash_attn takes float16 and bfloat16 only: a float32 decoder on it fails when it is
    built, naming the fix, instead of at its first pass."""
    from actors.model import split_attention
    from actors.model.llama import decoder_from_tensors

    monkeypatch.setattr(split_attention, "_flash_varlen", lambda: lambda *args, **kwargs: None)
    model = tiny_model[0]
    tensors = {name: tensor.float() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match="not float32: use dtype bfloat16, or attention_backend sdpa"):
        decoder_from_tensors(model.config, dict(tensors), attention_backend="split")
    bf16 = {name: tensor.bfloat16() for name, tensor in tensors.items()}
    assert decoder_from_tensors(model.config, bf16, attention_backend="split").backend.varlen is not None
    monkeypatch.setattr(split_attention, "_flash_varlen", lambda: None)  # no kernel: the torch path takes float32
    assert decoder_from_tensors(model.config, dict(tensors), attention_backend="split").backend.prefix_kernel == "torch"
