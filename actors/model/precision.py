"""Which dtype a model runs in when the user leaves it to us ("auto", the default).

bfloat16 halves the bytes every decode pass reads (weights and KV), and decode is memory bound; but
a CPU without native bfloat16 dot products (AVX512-BF16 or AMX) converts on every multiply and is
slower than float32, so only those CPUs get it, and only where every product gives a row the same
bits whatever else its pass holds (our kernels build: products over paired weights with AVX512-BF16,
our dot-product kernel wherever oneDNN's packed product would not keep a row's bits, attention):
then speculative greedy output is plain decoding's token for token in bfloat16 too (docs/lossless.md).
GPUs get bfloat16, as vLLM's auto gives a float32 checkpoint on one.
"""
from __future__ import annotations

import torch

from actors.model import kernels
from actors.model.projection import onednn_dtypes

AUTO = "auto"


def cpu_has_bfloat16() -> bool:
    """Native bfloat16 dot products: AVX512-BF16 or AMX tiles (x86; False elsewhere)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def cpu_bfloat16_is_exact() -> bool:
    """Whether a bfloat16 row's products here do not depend on its pass: our kernels are built (the
    paired-weight product where the CPU has AVX512-BF16, else oneDNN's packed product checked per
    shape by `projection.keeps_rows` with our dot-product kernel behind it, and attention), and
    oneDNN multiplies bfloat16 natively here, the sign the CPU does."""
    return torch.bfloat16 in onednn_dtypes() and kernels.available()


def resolve_dtype(dtype: str, device: str) -> str:
    """`dtype`, or for "auto" the fastest lossless-in-its-own-precision dtype for `device`."""
    if dtype != AUTO:
        return dtype
    if torch.device(device).type == "cpu":
        return "bfloat16" if cpu_has_bfloat16() and cpu_bfloat16_is_exact() else "float32"
    return "bfloat16"
