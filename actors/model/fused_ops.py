"""A decoder layer's elementwise steps, fused on a CPU (kernels/fused_ops.cpp), torch's ops elsewhere.

On a CPU each of these steps was several torch ops, each a pass over the rows and a dispatch (a
one-token pass of the default target spent about a tenth of its time in RMSNorm alone: figures in
docs/benchmarks.md, "Measurements behind the code"). Fused, each reads its inputs once, computes in
float32 and rounds once; each row's result depends on that row alone, as bfloat16 verification
needs (docs/lossless.md). Without our kernels (no compiler), on a GPU and in float64 the torch
path runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.model import kernels

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused(x: torch.Tensor) -> bool:
    """Whether `x`'s steps run fused here."""
    return x.device.type == "cpu" and x.dtype in FUSED_DTYPES and kernels.available()


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, norm: nn.RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, the norm of that): the residual stream and the next block's input."""
    if fused(hidden):
        return torch.ops.specserve.add_rms_norm(hidden.contiguous(), None if delta is None else delta.contiguous(),
                                                norm.weight, norm.eps)
    if delta is not None:
        hidden = hidden + delta
    return hidden, norm(hidden)


def silu_and_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """silu(gate) * up of a stacked gate/up product [rows, 2 x width] -> [rows, width]."""
    if fused(gate_up):
        return torch.ops.specserve.silu_and_mul(gate_up.contiguous())
    gate, up = gate_up.split(width, dim=-1)
    return F.silu(gate) * up
