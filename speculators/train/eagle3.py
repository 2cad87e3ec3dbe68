"""Training an EAGLE-3 head with training-time test (TTT).

Step 0 runs the head over every row of a packed batch, as serving runs committed tokens: row j
reads fc(the target's three layers at token j) and token j + 1, attends rows j' <= j of its
sequence and predicts token j + 2. Step s > 0 is what drafting s tokens past a committed row does:
row j reads the head's own output of step s - 1 and token j + s + 1, sits at position j + s,
attends step 0's rows j' <= j plus its own rows of steps 1..s (never another row's drafts), and
predicts token j + s + 2. Labels are the target's own greedy answers, so a correct prediction is
a token the target accepts; loss counts response tokens in the draft vocabulary.

The held-out acceptance estimate is what a chain of `steps` drafted tokens would keep: 1 plus
the mean number of leading steps predicted right, over response rows where all steps have labels.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from speculators.heads.eagle import EagleHead, attend
from speculators.train.packing import Packed


def new_head(target: LlamaConfig, vocabulary: torch.Tensor, aux_layers: tuple[int, ...],
             lm_head_rows: torch.Tensor) -> EagleHead:
    """A fresh EAGLE-3 head for `target` (one layer of the target's shape), its LM head started
    from the target's rows of the draft vocabulary."""
    layer = LlamaConfig(**{**target.to_dict(), "num_hidden_layers": 1, "tie_word_embeddings": False})
    head = EagleHead(layer, 3, target.hidden_size, len(vocabulary), aux_layers)
    head.apply(_init)
    head.set_vocabulary(vocabulary)
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_head_rows)
    return head


def _init(module: torch.nn.Module) -> None:
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)


class Eagle3Objective:
    def __init__(self, head: EagleHead, steps: int = 3):
        self.head, self.steps = head, steps
        self.to_draft = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
        self.to_draft[head.draft_to_target] = torch.arange(head.draft_vocab_size)

    def forward(self, batch: Packed) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per step: (the rows it ran, the head's outputs for them)."""
        head = self.head
        # rows whose output some step scores: the last `steps` + 1 prompt rows and the response's;
        # earlier prompt rows only give keys and values
        later = (batch.local + self.steps + 1 >= batch.prompt).nonzero().squeeze(1)
        q, k0, v0, residual = head.project(head.fuse(batch.hidden), batch.token(1), batch.local)
        causal = batch.causal_mask()[later]
        out = head.finish(attend(q[:, :, later], k0, v0, causal), residual[later])
        results, diagonal = [(later, out)], []
        for step in range(1, self.steps):
            q, k, v, residual = head.project(out, batch.token(step + 1)[later], batch.local[later] + step)
            diagonal.append((k, v))
            out = head.finish(self._attend_ttt(q, k0, v0, causal, diagonal), residual)
            results.append((later, out))
        return results

    def __call__(self, batch: Packed) -> tuple[torch.Tensor, dict[str, float]]:
        outputs = self.forward(batch)
        later = outputs[0][0]
        losses, sums = [], {}
        correct = torch.zeros(len(later), self.steps, dtype=torch.bool, device=later.device)
        valid = torch.ones(len(later), dtype=torch.bool, device=later.device)
        for step, (rows, out) in enumerate(outputs):
            loss, right, labelled = self._score(out, batch, rows, step)
            losses.append(loss)
            sums[f"correct{step}"], sums[f"labelled{step}"] = float(right.sum()), float(labelled.sum())
            correct[:, step], valid = right, valid & labelled
        leading = correct.long().cumprod(1).sum(1)[valid]
        total = torch.stack(losses).mean()
        sums.update(accepted=float(leading.sum()), chains=float(len(leading)), loss=float(total.detach()), batches=1.0)
        return total, sums

    def _attend_ttt(self, q, k0, v0, mask0, diagonal):
        """Attention of step-s rows over step 0's rows (masked) and their own rows of steps 1..s."""
        groups = q.shape[1] // k0.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        keys0, values0 = k0.repeat_interleave(groups, 1), v0.repeat_interleave(groups, 1)
        scores = (q @ keys0.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask0[None, None], float("-inf"))
        own_keys = [k.repeat_interleave(groups, 1) for k, _ in diagonal]
        own = torch.stack([(q * k).sum(-1) * scale for k in own_keys], dim=-1)  # [1, heads, rows, s]
        weights = torch.cat([scores, own], dim=-1).softmax(-1)
        steps = len(diagonal)
        result = weights[..., :-steps] @ values0
        for index, (_, v) in enumerate(diagonal):
            result = result + weights[..., -steps + index, None] * v.repeat_interleave(groups, 1)
        return result

    def _score(self, out: torch.Tensor, batch: Packed, rows: torch.Tensor, step: int):
        """(loss, right [len(rows)], labelled [len(rows)]) of predicting token j + step + 2."""
        labels = batch.token(step + 2)[rows]
        labelled = batch.response_label(step + 2)[rows]
        self.to_draft = self.to_draft.to(labels.device)
        draft_labels = self.to_draft[labels]
        trainable = (labelled & (draft_labels >= 0)).nonzero().squeeze(1)
        logits = self.head.logits(out[trainable]).float()
        loss = F.cross_entropy(logits, draft_labels[trainable]) if len(trainable) else logits.sum() * 0
        right = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
        right[trainable] = logits.argmax(-1) == draft_labels[trainable]
        return loss, right, labelled

    def summary(self, sums: dict[str, float]) -> dict[str, float]:
        """Readable figures from summed metrics: loss, top-1 per step, estimated accepted tokens."""
        if not sums:
            return {}
        result = {"loss": sums["loss"] / max(sums["batches"], 1)}
        for step in range(self.steps):
            result[f"top1@{step + 1}"] = sums[f"correct{step}"] / max(sums[f"labelled{step}"], 1)
        result["accept"] = 1 + sums["accepted"] / max(sums["chains"], 1)
        return result
