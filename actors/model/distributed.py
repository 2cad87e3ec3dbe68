"""Collectives over a torch.distributed process group, for tensor-parallel target shards.

One process per rank (a Ray actor each); gloo on CPU, NCCL on CUDA. Every rank must make the same
collective calls in the same order, or they wait on each other forever: the decoder's forward pass
does that by construction (same batch on every rank), and callers must keep every rank's calls in
the same order (see TargetGroup).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from actors.model.config import DecoderConfig
from actors.model.sharding import Communicator, ShardPlan


def bind_device(device: str | torch.device) -> torch.device:
    """The device this process computes on, made current when it is a GPU.

    A shard's kernels, its NCCL communicator and any tensor created as plain "cuda" must all use the
    shard's own GPU; without `torch.cuda.set_device` they would go to GPU 0 of what the process sees
    (under Ray that is the shard's GPU, elsewhere maybe another rank's).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return device
    device = torch.device("cuda", 0 if device.index is None else device.index)
    torch.cuda.set_device(device)
    return device


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: str | torch.device = "cpu",
    timeout_s: float = 600.0,
) -> None:
    """Join this process to the group of `world_size` ranks rendezvousing at master_addr:master_port.

    NCCL for ranks on GPUs, gloo for ranks on CPUs. The timeout bounds how long a rank waits for
    the others (at rendezvous and in every collective), so a rank that died turns into an error on
    the others instead of a silent hang.
    """
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


class TorchDistributedComm(Communicator):
    """The collectives of one rank of a sharded decoder, over the default process group.

    `config` gives every rank's vocabulary slice (uneven when the vocabulary does not divide), which
    all_gather_last_dim needs because torch's all_gather wants equal shapes on every rank.
    `device` is where broadcast_object stages its bytes (NCCL only moves CUDA tensors).
    """

    def __init__(self, config: DecoderConfig, device: str | torch.device = "cpu"):
        if not dist.is_initialized():
            raise RuntimeError("TorchDistributedComm needs init_process_group first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device)
        self._vocab_sizes = [
            end - start for start, end in (ShardPlan(r, self.world_size).vocab(config) for r in range(self.world_size))
        ]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()  # collectives act on storage: a strided view would sum the wrong elements
        dist.all_reduce(tensor)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary slice of `tensor`, concatenated in rank order on every rank."""
        if tensor.shape[-1] != self._vocab_sizes[self.rank]:
            raise ValueError(
                f"rank {self.rank} holds {self._vocab_sizes[self.rank]} vocabulary rows, got {tensor.shape[-1]}"
            )
        widest = max(self._vocab_sizes)
        padded = F.pad(tensor, (0, widest - tensor.shape[-1])).contiguous()
        pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(pieces, padded)
        return torch.cat([piece[..., :size] for piece, size in zip(pieces, self._vocab_sizes)], dim=-1)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        pieces = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(pieces, tensor.contiguous())
        return pieces

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        holder = [obj if self.rank == src else None]
        dist.broadcast_object_list(holder, src=src, device=self.device)
        return holder[0]
