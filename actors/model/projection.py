"""x @ W.T for the decoder's projections, the fastest way for the device that keeps a row's bits its own.

In float32 on a CPU the few rows of a decoding or verification pass take our kernel
(kernels/linear.cpp): it reads the weights at memory speed from one row up, where torch's products
took 1.5-2x that on a CPU without AVX-512 (AMD Zen), and it sums every row the same way at any row
count, so those rows' bits are their own. Larger calls (prompts) take oneDNN, faster there.

Speculative greedy output equals plain decoding's only if a row's product does not depend on the
other rows of its pass (docs/lossless.md). In bfloat16 on a CPU with AVX512-BF16 every product takes
our kernel over a paired copy of the weight (`paired_weight`, `linear_pairs`): each output summed
over the input pairs in order, so a row's bits are its own at any row count and thread count, at
oneDNN's speed or better from 1 to 1,024 rows. Elsewhere (bfloat16 asked for on a CPU without it)
oneDNN gave a row the same bits in
calls of 1 to 128 rows on one machine, but not on another (an AVX512-FP16 Xeon: the down projection,
1,536 inputs, changed rows of calls of several rows), so that is probed once per
weight shape and thread count (`keeps_rows`), and a shape where it fails takes our kernel at every
row count (it sums each output one fixed way; 1.0-1.4x oneDNN's time there). Past 128 rows oneDNN's
bits depend on the call's row count, the weight's shape and the thread count (that down projection
changed at 160-256 rows on two threads and from 193 on one on the first machine), and a 128-row
call is far slower a row than a large one (a 1,024-token prompt's products 1.55x). So a large call
is split into the largest counts that this weight shape, at this thread count, was seen to give
every row the bits of 128-row calls (`row_invariant`).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from actors.model import kernels

OWN_KERNEL_ROWS = 64
"""Up to this many rows a float32 CPU product takes our kernel. Whole 30-layer products of the default
target on 2 Zen cores, ours against `project`'s torch path (docs/benchmarks.md, "float32 products
of our own"): 1 row 29 against 56 ms, 4 rows 43 / 62, 16 rows 85 / 106, 32 rows 137 / 160, 64
rows ~300 / ~310; 128 rows level, 256 rows 0.93x, 1,024 rows 0.7x."""
SMALL_ROWS = 2
"""Up to this many rows a float32 CPU product without our kernel runs as `(W @ x.T).T` (see `project`)."""


def _onednn_linear() -> Callable | None:
    """oneDNN's linear, when this torch build has it."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    return None if op is None else lambda x, weight, bias: op(x, weight, bias, "none", [], "")


ONEDNN_LINEAR = _onednn_linear()
ONEDNN_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if ONEDNN_LINEAR is not None else None
PACK_ROWS_HINT = {torch.float32: 16, torch.bfloat16: 1, torch.float16: 1}
"""The row count oneDNN blocks a packed weight for. float32: 16, measured as fast as a count's own
packing from 3 to 256 rows and no slower at one. Half precision: 1, as fast, and the only hint
measured to give a row the same bits at every row count of the call (with 16, the LM head's rows
changed from 33 rows on): what bfloat16 verification needs to equal plain decoding."""


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN packs and multiplies on this CPU. Its reduced-precision paths need
    instruction sets some x86 CPUs lack (bfloat16: AVX512-BW/VL/DQ or AVX-NE-CONVERT), and it says
    so only by raising on the first pack; those dtypes take torch's own products instead."""
    if ONEDNN_PACK is None:
        return ()
    packable = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        weight, x = torch.ones(16, 16, dtype=dtype), torch.ones(4, 16, dtype=dtype)
        try:
            ONEDNN_LINEAR(x, ONEDNN_PACK(weight, PACK_ROWS_HINT[dtype]), None)
        except RuntimeError:
            continue
        packable.append(dtype)
    return tuple(packable)


@functools.cache
def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """`_packable_dtypes`, found once, on a thread of its own that ends with the probe. libgomp keeps
    a pool of OpenMP threads for each thread that computes in parallel, and while a second pool
    exists it stops spinning at barriers: a probe on the importing thread left one beside the engine
    thread's, and the engine's passes took 1.6-2x as long."""
    found: list[torch.dtype] = []
    probe = threading.Thread(target=lambda: found.extend(_packable_dtypes()), name="onednn-probe")
    probe.start()
    probe.join()
    return tuple(found)


INVARIANT_ROWS = 128
"""oneDNN gives a half-precision row the same bits in every call of 1 to this many rows (measured on
every shape of the default target, at one and two threads)."""
LARGE_CALL_ROWS = (2048, 1024, 512, 384, 256, 192)
"""Row counts past `INVARIANT_ROWS` a half-precision call may have where `row_invariant` finds
them invariant, largest first."""
_invariant_counts: dict[tuple, bool] = {}
"""(dtype, weight shape, bias or not, threads, rows) -> whether a call of that many rows gives every
row the bits of 128-row calls."""
_packed_weights = WeakIdKeyDictionary()
"""weight -> (its version when packed, oneDNN's packed copy): made on first use, again after an
in-place change (a load, a test setting weights)."""


_paired_weights = WeakIdKeyDictionary()
"""weight -> (its version when paired, its copy laid out for `linear_pairs`): made on first use (at
load, by `probe_products`), again after an in-place change."""


@functools.cache
def pairs_kernel() -> bool:
    """Whether bfloat16 products take our kernel over paired weights: built for a CPU with AVX512-BF16."""
    return kernels.available() and torch.ops.specserve.pairs_built()


def _takes_pairs(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and pairs_kernel())


def paired_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] as [out / 16, in / 2, 16, 2] (outputs padded to a multiple of 16 with
    zeros): one 64-byte vector holds an input pair's weights for 16 outputs. A copy, like oneDNN's
    packed weight, which bfloat16 then no longer makes."""
    def pair(weight: torch.Tensor) -> torch.Tensor:
        outputs, inputs = weight.shape
        padded = torch.cat([weight, weight.new_zeros(-outputs % 16, inputs)])
        return padded.view(-1, 16, inputs // 2, 2).transpose(1, 2).contiguous()

    return _current_copy(_paired_weights, weight, pair)


def _current_copy(copies: WeakIdKeyDictionary, weight: torch.Tensor,
                  make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`make(weight)`, kept in `copies` until the weight changes in place (its version moves)."""
    entry = copies.get(weight)
    if entry is None or entry[0] != weight._version:
        entry = copies[weight] = (weight._version, make(weight.detach()))
    return entry[1]


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed (blocked) copy of a contiguous CPU weight: with it a pass of 16 sequences x
    1 token took 0.70 of the time in float32 and 0.86 in bfloat16, and a one-token pass in bfloat16
    0.66, where unpacked oneDNN takes a slow path (docs/benchmarks.md, "Measurements behind the
    code"). The copy doubles the weights' memory on a CPU."""
    return _current_copy(_packed_weights, weight, lambda w: ONEDNN_PACK(w, PACK_ROWS_HINT[w.dtype]))


def row_invariant(rows: int, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a half-precision call of `rows` rows over `weight` gives every row the bits that
    calls of `INVARIANT_ROWS` rows give it, at torch's thread count now. Found once per weight
    shape, thread count and row count, on random rows: a call that sums a row's products in
    another order changes some of thousands of outputs, so one probe tells (it costs about two
    calls of that size, once)."""
    if rows <= INVARIANT_ROWS:
        return True
    key = (weight.dtype, tuple(weight.shape), bias is not None, torch.get_num_threads(), rows)
    known = _invariant_counts.get(key)
    if known is None:
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        alone = [ONEDNN_LINEAR(x[first:first + INVARIANT_ROWS], packed, bias) for first in range(0, rows, INVARIANT_ROWS)]
        known = _invariant_counts[key] = torch.equal(ONEDNN_LINEAR(x, packed, bias), torch.cat(alone))
    return known


PROBED_COUNTS = (*range(2, 25), 32, 48, 64, 65, 96, 128)
"""Row counts a half-precision call is probed at for `keeps_rows`: every count to 24 (oneDNN changed
kernels from 2 or 7 rows on one machine), then the counts where blocks of rows end. Every row of
each call is compared: another summation order changes a bfloat16 row in about one case of ten, so
a sample of rows can miss it. The LM head's probe (49,152 x 576) costs ~0.3-0.8 s on a 2-core CPU,
once per thread count: at load for the count then (`probe_products`), on the first pass for another."""
_keeps_rows: dict[tuple, bool] = {}


def keeps_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether oneDNN gives every row of a half-precision call of 1 to 128 rows over this weight shape
    the bits it gets alone, at torch's thread count now. Measured, once per shape and thread count:
    on a Xeon with AVX512-FP16 the down projection (1,536 inputs) gave rows of calls of 2 rows or
    more other bits than alone, where another machine's oneDNN kept them."""
    key = (weight.dtype, tuple(weight.shape), bias is not None, torch.get_num_threads())
    known = _keeps_rows.get(key)
    if known is None:
        packed = packed_weight(weight)
        x = torch.randn(INVARIANT_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        alone = torch.cat([ONEDNN_LINEAR(x[i:i + 1], packed, bias) for i in range(INVARIANT_ROWS)])
        known = _keeps_rows[key] = all(torch.equal(ONEDNN_LINEAR(x[:count], packed, bias), alone[:count])
                                       for count in PROBED_COUNTS)
    return known


def _probed(weight: torch.Tensor) -> bool:
    """Whether a product over this weight asks `keeps_rows` (bfloat16 that oneDNN packs on a CPU,
    our kernel built to take over); only asked where the paired kernel does not take the weight."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dtype in onednn_dtypes()
            and weight.is_contiguous() and kernels.available())


def probe_products(products: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """At load, so that a model's first request pays neither: the paired copies of its bfloat16
    weights, or else `keeps_rows` for its products (weight, bias) at torch's thread count then (the
    LM head's probe: 0.3-0.8 s on 2 cores)."""
    for weight, bias in products:
        if _takes_pairs(weight):
            paired_weight(weight)
        elif _probed(weight):
            keeps_rows(weight, bias)


def call_counts(rows: int, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> list[int]:
    """The row counts a half-precision product of `rows` rows is split into: the largest invariant
    count that fits, again, then what is left (at most `INVARIANT_ROWS` a call)."""
    counts = []
    while rows > INVARIANT_ROWS:
        count = next((n for n in LARGE_CALL_ROWS if n <= rows and row_invariant(n, weight, packed, bias)), INVARIANT_ROWS)
        counts.append(count)
        rows -= count
    return counts + [rows] if rows else counts


class Projection(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) with the fastest product for the row counts
    speculative decoding runs; see `project`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [rows, in], the fastest way for the device.

    A product autograd must differentiate (training) takes F.linear: our kernel and oneDNN's packed
    weight have no backward. bfloat16 on a CPU with AVX512-BF16: our kernel over the paired weight,
    at any row count. float32 on a CPU, up to `OWN_KERNEL_ROWS` rows: our kernel, where it is
    built; bfloat16 at any row count, where oneDNN does not keep a row's bits for this shape
    (`keeps_rows`). Otherwise, on a CPU (2 cores, AVX-512, MKL, oneDNN), measured in whole passes of the default target:
    oneDNN's linear over a packed copy of the weight (`packed_weight`) in bfloat16 at every row
    count (a large pass in the calls `call_counts` gives) and in float32 past `SMALL_ROWS` rows; up
    to there, `(W @ x.T).T`, which reads float32 weights at memory speed for 2 rows (1 row takes a
    slower matrix-vector path, so it gets a zero row). F.linear costs about the same for 1 to 16
    rows, well above what the weights' memory traffic allows. oneDNN only gets contiguous weights:
    on a strided one (a tensor-parallel column slice) it takes a far slower reference path. On CUDA, plain F.linear.
    Figures: docs/benchmarks.md, "Measurements behind the code".
    """
    if x.device.type != "cpu" or x.dim() != 2 or _needs_gradient(x, weight, bias):
        return F.linear(x, weight, bias)
    if x.dtype == torch.bfloat16 and _takes_pairs(weight):
        x = x if x.stride(-1) == 1 else x.contiguous()
        return torch.ops.specserve.linear_pairs(x, paired_weight(weight), bias, weight.shape[0])
    rows = x.shape[0]
    own_float32 = (rows <= OWN_KERNEL_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32
                   and weight.is_contiguous() and kernels.available())
    if own_float32 or (x.dtype == weight.dtype and _probed(weight) and not keeps_rows(weight, bias)):
        return torch.ops.specserve.linear(x if x.stride(-1) == 1 else x.contiguous(), weight, bias)
    packs = x.dtype in onednn_dtypes() and weight.dtype == x.dtype and weight.is_contiguous()
    if packs and x.dtype != torch.float32 and rows > INVARIANT_ROWS:
        packed = packed_weight(weight)
        parts = [ONEDNN_LINEAR(part, packed, bias) for part in x.contiguous().split(call_counts(rows, weight, packed, bias))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    if packs and (rows > SMALL_ROWS or x.dtype != torch.float32):
        return ONEDNN_LINEAR(x.contiguous(), packed_weight(weight), bias)
    if rows > SMALL_ROWS:
        return F.linear(x, weight, bias)
    if rows == 1:  # one row takes a slower matrix-vector path
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])
    # MKL's fast path wants x.T column-major, i.e. x row-major; so is the output, for what follows
    out = (weight @ x.contiguous().t()).t()[:rows].contiguous()
    return out if bias is None else out + bias


def _needs_gradient(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
