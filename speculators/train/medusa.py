"""Training Medusa heads, and choosing their tree from what they achieve on held-out data.

Head k reads the target's final hidden state of token j and predicts token j + k + 2 (the target's
own greedy answer); the heads share one LM head over the draft vocabulary, started from the
target's, and their residual blocks start at zero (each head starts as the target's own next-token
guess). Held-out, the rank of the true token under each head gives the tree (speculators/train/ranks.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from speculators.heads.medusa import MedusaHeads
from speculators.train.packing import Packed
from speculators.train.ranks import MAX_RANK, DepthRanks


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


class MedusaObjective(DepthRanks):
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
            ranks[k, trainable] = self.ranks(head_logits, labels[trainable])
            self.add_ranks(sums, k, ranks[k, trainable], int(labelled.sum()))
        full = torch.stack([batch.response_label(k + 2) for k in range(self.steps)]).all(0)
        leading = (ranks[:, full] == 0).long().cumprod(0).sum(0)
        total = torch.stack(losses).mean()
        sums.update(accepted=float(leading.sum()), chains=float(full.sum()), loss=float(total.detach()), batches=1.0)
        return total, sums
