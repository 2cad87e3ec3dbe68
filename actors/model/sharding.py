"""How one tensor-parallel rank's slice of a decoder is cut (Megatron style).

Attention is split by key/value head groups (each rank keeps whole GQA groups, so no rank needs
another's K/V), the MLP by intermediate columns, and the embedding / LM head by vocabulary rows.
Splits are as even as possible, so a model with 3 KV heads still runs on 2 ranks (2 + 1 groups).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from actors.model.config import DecoderConfig


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items are cut into `parts` near-equal runs."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class ShardPlan:
    rank: int = 0
    world_size: int = 1

    def validate(self, config: DecoderConfig) -> None:
        if config.num_kv_heads < self.world_size:
            raise ValueError(
                f"tensor parallel size {self.world_size} exceeds the model's {config.num_kv_heads} KV heads"
            )

    def kv_heads(self, config: DecoderConfig) -> tuple[int, int]:
        return even_split(config.num_kv_heads, self.world_size, self.rank)

    def q_heads(self, config: DecoderConfig) -> tuple[int, int]:
        group = config.num_heads // config.num_kv_heads
        start, end = self.kv_heads(config)
        return start * group, end * group

    def intermediate(self, config: DecoderConfig) -> tuple[int, int]:
        return even_split(config.intermediate_size, self.world_size, self.rank)

    def vocab(self, config: DecoderConfig) -> tuple[int, int]:
        return even_split(config.vocab_size, self.world_size, self.rank)


class Communicator:
    """Collectives a sharded decoder needs; the single-process version does nothing."""

    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on every rank), in rank order."""
        return [tensor]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` as rank `src` holds it, on every rank: how one rank's decision reaches the others."""
        return obj
