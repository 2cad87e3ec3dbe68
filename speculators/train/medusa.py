"""Training Medusa heads, and choosing their tree from what they achieve on held-out data.

Head k reads the target's final hidden state of token j and predicts token j + k + 2 (the target's
own greedy answer); the heads share one LM head over the draft vocabulary, started from the
target's, and their residual blocks start at zero (each head starts as the target's own next-token
guess). Held-out, the rank of the true token under each head gives the tree: paths are added in
order of their estimated probability of being accepted (the product of each depth's chance that
the true token sits at that rank), as the Medusa paper builds its trees.
"""
from __future__ import annotations

import heapq

import torch
import torch.nn.functional as F

from speculators.heads.medusa import MedusaHeads
from speculators.train.packing import Packed

MAX_RANK = 8
"""Ranks counted per head for the tree search."""


def new_heads(hidden_size: int, vocab_size: int, num_heads: int, vocabulary: torch.Tensor,
              lm_head_rows: torch.Tensor) -> MedusaHeads:
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, 1, len(vocabulary), shared_lm_head=True)
    with torch.no_grad():
        for block in heads.blocks:
            torch.nn.init.zeros_(block.layers[0].weight)
            torch.nn.init.zeros_(block.layers[0].bias)
        heads.lm_heads[0].weight.copy_(lm_head_rows)
        heads.token_map.copy_(vocabulary)
    return heads


class MedusaObjective:
    def __init__(self, heads: MedusaHeads):
        self.heads = heads
        self.steps = heads.num_heads
        self.to_draft = torch.full((heads.vocab_size,), -1, dtype=torch.long)
        self.to_draft[heads.token_map] = torch.arange(heads.draft_vocab_size)

    def __call__(self, batch: Packed) -> tuple[torch.Tensor, dict[str, float]]:
        logits = self.heads(batch.hidden).float()  # [heads, rows, draft vocab]
        self.to_draft = self.to_draft.to(logits.device)
        losses, sums = [], {}
        ranks = torch.full((self.steps, batch.rows), MAX_RANK, dtype=torch.long, device=logits.device)
        for k in range(self.steps):
            labels = self.to_draft[batch.token(k + 2)]
            labelled = batch.response_label(k + 2)
            trainable = (labelled & (labels >= 0)).nonzero().squeeze(1)
            head_logits = logits[k, trainable]
            losses.append(F.cross_entropy(head_logits, labels[trainable]) if len(trainable) else head_logits.sum() * 0)
            label_logit = head_logits.gather(1, labels[trainable, None])
            ranks[k, trainable] = (head_logits > label_logit).sum(1).clamp(max=MAX_RANK)
            sums[f"labelled{k}"] = float(labelled.sum())
            for rank in range(MAX_RANK):
                sums[f"rank{k}.{rank}"] = float((ranks[k, trainable] == rank).sum())
        full = torch.stack([batch.response_label(k + 2) for k in range(self.steps)]).all(0)
        leading = (ranks[:, full] == 0).long().cumprod(0).sum(0)
        total = torch.stack(losses).mean()
        sums.update(accepted=float(leading.sum()), chains=float(full.sum()), loss=float(total.detach()), batches=1.0)
        return total, sums

    def rank_rates(self, sums: dict[str, float]) -> list[list[float]]:
        """Per head, the share of labelled tokens found at each rank."""
        return [[sums.get(f"rank{k}.{r}", 0.0) / max(sums.get(f"labelled{k}", 0.0), 1) for r in range(MAX_RANK)]
                for k in range(self.steps)]

    def summary(self, sums: dict[str, float]) -> dict[str, float]:
        if not sums:
            return {}
        result = {"loss": sums["loss"] / max(sums["batches"], 1)}
        for k, rates in enumerate(self.rank_rates(sums)):
            result[f"top1@{k + 1}"] = rates[0]
        result["accept"] = 1 + sums["accepted"] / max(sums["chains"], 1)
        return result


def choose_tree(rank_rates: list[list[float]], size: int) -> list[list[int]]:
    """The `size` paths with the highest estimated acceptance (best first), every prefix included."""
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
