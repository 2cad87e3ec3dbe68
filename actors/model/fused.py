"""Projections of the same input run as one product while their weights lie back to back.

q/k/v (and gate/up) multiply the same rows; one product over their stacked weights costs less than
separate ones on the CPU at every row count tried (fewer, larger calls; figures: docs/benchmarks.md,
"Measurements behind the code"), and it is what GPU servers do too. Parameters keep their Hugging
Face names and shapes: `stack_in_place` makes them views of one tensor when a decoder is built from
its tensors, and `JointProjection` takes the one-product path only while they still are views of it
(a state dict assigned later, or a decoder built without the loader, runs them one by one), so a
stacked weight can never go stale.
"""
from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import torch
from torch import nn


def stacked_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The parts as one tensor stacked along dim 0, when they lie back to back in one storage
    (a view, no copy); None when they do not."""
    first = parts[0]
    offset = first.storage_offset()
    for part in parts:
        if (not part.is_contiguous() or part.dtype != first.dtype or part.shape[1:] != first.shape[1:]
                or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or part.storage_offset() != offset):
            return None
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def stack_in_place(tensors: MutableMapping[str, torch.Tensor], names: Sequence[str]) -> None:
    """Make tensors[name] for `names` views of one tensor holding them stacked along dim 0 (no copy
    when they already are; left alone when they cannot be stacked)."""
    parts = [tensors[name] for name in names]
    first = parts[0]
    if stacked_view(parts) is not None or any(
            p.shape[1:] != first.shape[1:] or p.dtype != first.dtype or p.device != first.device for p in parts):
        return
    stacked, offset = torch.cat(parts), 0
    for name, part in zip(names, parts):
        tensors[name] = stacked[offset: offset + part.shape[0]]
        offset += part.shape[0]


class JointProjection:
    """Several projections of one input: one product while their parameters are stacked views."""

    def __init__(self, projections: Sequence[nn.Linear], project):
        self.projections = tuple(projections)
        self.sizes = [p.out_features for p in self.projections]
        self.project = project
        self._key: tuple | None = None
        self._stacked: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, x: torch.Tensor) -> Sequence[torch.Tensor]:
        joint = self.joint(x)
        if joint is None:
            return [projection(x) for projection in self.projections]
        return joint.split(self.sizes, dim=-1)

    def joint(self, x: torch.Tensor) -> torch.Tensor | None:
        """The one product [rows, sum of sizes], its parts side by side; None while the parameters
        are not stacked."""
        stacked = self._weights()
        return None if stacked is None else self.project(x, *stacked)

    def products(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of each product it makes: the stacked one, or each projection's."""
        stacked = self._weights()
        return [stacked] if stacked is not None else [(p.weight, p.bias) for p in self.projections]

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        weights = [p.weight for p in self.projections]
        biases = [p.bias for p in self.projections]
        key = tuple(t.data_ptr() for t in weights) + tuple(0 if b is None else b.data_ptr() for b in biases)
        if key != self._key:
            weight = stacked_view(weights)
            has_bias = [b is not None for b in biases]
            bias = stacked_view(biases) if all(has_bias) else None
            usable = weight is not None and (bias is not None or not any(has_bias))
            self._key, self._stacked = key, (weight, bias) if usable else None
        return self._stacked
