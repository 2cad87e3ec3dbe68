"""The rank of the true token at each drafted depth, for drafters that predict every depth at once
(Medusa heads, DFlash blocks): the held-out figures they report and the static tree they draft,
chosen from those ranks as the Medusa paper builds its trees."""
from __future__ import annotations

import heapq

import torch

MAX_RANK = 8
"""Ranks counted per depth for the tree search."""


class DepthRanks:
    """Sums of labelled tokens per depth and rank (`rank{k}.{r}`, `labelled{k}`), and what they give."""

    steps: int
    """Depths predicted."""

    @staticmethod
    def ranks(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Rank of each label under its row of logits [n, V], capped at MAX_RANK."""
        return (logits > logits.gather(1, labels[:, None])).sum(1).clamp(max=MAX_RANK)

    @staticmethod
    def add_ranks(sums: dict[str, float], depth: int, ranks: torch.Tensor, labelled: int) -> None:
        sums[f"labelled{depth}"] = float(labelled)
        for rank in range(MAX_RANK):
            sums[f"rank{depth}.{rank}"] = float((ranks == rank).sum())

    def rank_rates(self, sums: dict[str, float]) -> list[list[float]]:
        """Per depth, the share of labelled tokens found at each rank."""
        return [[sums.get(f"rank{k}.{r}", 0.0) / max(sums.get(f"labelled{k}", 0.0), 1) for r in range(MAX_RANK)]
                for k in range(self.steps)]

    def summary(self, sums: dict[str, float]) -> dict[str, float]:
        """Loss, top-1 per depth, and accepted tokens per pass of a chain (1 + leading right guesses)."""
        if not sums:
            return {}
        result = {"loss": sums["loss"] / max(sums["batches"], 1)}
        for k, rates in enumerate(self.rank_rates(sums)):
            result[f"top1@{k + 1}"] = rates[0]
        result["accept"] = 1 + sums["accepted"] / max(sums["chains"], 1)
        return result


def choose_tree(rank_rates: list[list[float]], size: int) -> list[list[int]]:
    """The `size` paths with the highest estimated acceptance (best first), every prefix included:
    a path's estimate is the product of each depth's chance that the true token sits at its rank."""
    chosen: list[list[int]] = []
    frontier = [(-rank_rates[0][r], (r,)) for r in range(len(rank_rates[0]))]
    heapq.heapify(frontier)
    while frontier and len(chosen) < size:
        negative, path = heapq.heappop(frontier)
        chosen.append(list(path))
        depth = len(path)
        if depth < len(rank_rates):
            for rank in range(len(rank_rates[depth])):
                heapq.heappush(frontier, (negative * rank_rates[depth][rank], (*path, rank)))
    return chosen
