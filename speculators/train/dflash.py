"""Training a DFlash block drafter (speculators/heads/dflash.py) on the target's own answers.

A training block sits at an anchor p, a position of a packed sequence whose next token is part of
the response: its rows are token p and `block_size - 1` mask tokens at positions p .. p + B - 1.
They attend the context rows of their own sequence at positions < p (what serving holds when p is
the root) and every row of their own block; block row k predicts token p + k, the target's own
greedy answer (a label outside the draft vocabulary, where the drafter has one, counts as a miss).
Each step samples up to `anchors` such positions of the batch at random (seeded), as DFlash
trains, and runs all their blocks in one pass under one mask. Depth k's loss is weighted by
exp(-(k - 1) / (B / 2)): the early depths decide how much of a block is accepted.

The held-out figures are those of Medusa heads (speculators/train/ranks.py): top-1 per depth, the
accepted tokens per pass of a chain, and the rank rates the drafter's static tree is chosen from.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config

from speculators.heads.dflash import DFlashDrafter
from speculators.train.packing import Packed
from speculators.train.ranks import DepthRanks

ANCHORS = 128
"""Blocks per training step (a step of 2,048 rows: about one anchor in twelve response tokens)."""


def new_drafter(target: LlamaConfig, layer_ids: tuple[int, ...], num_layers: int, block_size: int,
                mask_token_id: int, vocabulary: torch.Tensor | None = None,
                lm_head_rows: torch.Tensor | None = None) -> DFlashDrafter:
    """A fresh drafter of `num_layers` layers of the target's shape, reading the outputs of target
    layers `layer_ids`; with a `vocabulary` (target ids), its own LM head over those tokens,
    started from the target's rows `lm_head_rows`."""
    values = target.to_dict()
    rope = {"rope_parameters": values["rope_parameters"]} if values.get("rope_parameters") else {
        "rope_theta": values.get("rope_theta", 10000.0)}
    config = Qwen3Config(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                         intermediate_size=target.intermediate_size, num_hidden_layers=num_layers,
                         num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                         head_dim=getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads,
                         hidden_act=target.hidden_act, rms_norm_eps=target.rms_norm_eps,
                         max_position_embeddings=target.max_position_embeddings, attention_bias=False,
                         tie_word_embeddings=False, **rope)
    drafter = DFlashDrafter(config, layer_ids, block_size, mask_token_id, target.hidden_size,
                            draft_vocab_size=None if vocabulary is None else len(vocabulary))
    for module in drafter.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    if vocabulary is not None:
        drafter.set_vocabulary(vocabulary)
        with torch.no_grad():
            drafter.lm_head.weight.copy_(lm_head_rows)
    return drafter


def start_from_target(drafter: DFlashDrafter, read: Callable[[list[str]], dict[str, torch.Tensor]],
                      num_target_layers: int, features: torch.Tensor) -> None:
    """Start the drafter's layers as the target's last layers, reading the last target hidden state
    it is given (`fc` selects it) and ending in the target's final norm; `read(names)` gives the
    target's tensors by their Hugging Face names, `features` [n, len(ids) x Ht] are recorded context rows.

    Why: random layers behind q/k norms start attending almost uniformly over the whole context and
    learn to find the recent rows slowly; the target's layers bring its recent-token and copying
    heads (SmolLM2-135M, 100 steps: held-out loss 5.46 against 6.14, top-1 at depth 1 0.102 against
    0.086). The q/k norms, which the target's Llama layers lack, start at the typical per-head RMS of
    the target's own queries and keys over `features`, so attention starts at the target's sharpness."""
    first, size = num_target_layers - len(drafter.layers), drafter.config.hidden_size
    names = [f"model.layers.{first + i}.{name}" for i, layer in enumerate(drafter.layers) for name, _ in layer.named_parameters()]
    weights = read(names + ["model.norm.weight"])
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -size:] = torch.eye(size)
        drafter.hidden_norm.weight.copy_(weights[f"model.layers.{first}.input_layernorm.weight"])
        drafter.norm.weight.copy_(weights["model.norm.weight"])
        context = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight)))
        for index, layer in enumerate(drafter.layers):
            for name, tensor in layer.named_parameters():
                source = weights.get(f"model.layers.{first + index}.{name}")
                if source is not None:
                    tensor.copy_(source)
            attn = layer.self_attn
            for projection, norm in ((attn.q_proj, attn.q_norm), (attn.k_proj, attn.k_norm)):
                heads = projection(context).view(len(context), -1, attn.head_dim)
                norm.weight.fill_(float(heads.pow(2).mean(-1).sqrt().mean()))


class DFlashObjective(DepthRanks):
    def __init__(self, drafter: DFlashDrafter, anchors: int = ANCHORS, seed: int = 0):
        self.drafter, self.anchors = drafter, anchors
        self.steps = drafter.block_size - 1
        self.weights = torch.tensor([math.exp(-k / (drafter.block_size / 2)) for k in range(self.steps)])
        self.generator = torch.Generator().manual_seed(seed)
        self.to_draft = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long)
        self.to_draft[drafter.draft_to_target.cpu()] = torch.arange(len(drafter.draft_to_target))

    def blocks(self, batch: Packed, anchors: torch.Tensor) -> torch.Tensor:
        """Outputs [len(anchors), block_size, H] of the blocks rooted at rows `anchors` (ascending) of `batch`.

        Attention is computed per sequence, and within a block only between its own rows: a mask
        over the whole batch's rows and blocks would cost (blocks x size)^2 for the few
        size x size squares it keeps."""
        drafter, size = self.drafter, self.drafter.block_size
        context = drafter.context(batch.hidden, batch.local)
        pos = batch.local[anchors]
        groups = []  # (block rows, context rows, which context rows each block row sees) per sequence
        sequences, counts = torch.unique_consecutive(batch.sequence[anchors], return_counts=True)
        starts = torch.searchsorted(batch.sequence, sequences)
        ends = torch.searchsorted(batch.sequence, sequences, right=True)
        first = 0
        for start, end, count in zip(starts.tolist(), ends.tolist(), counts.tolist()):
            sees = batch.local[None, start:end] < pos[first:first + count, None]
            groups.append((slice(first * size, (first + count) * size), slice(start, end), sees.repeat_interleave(size, 0)))
            first += count

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = context[layer]
            return torch.cat([_block_attention(q[:, :, block], keys[:, :, rows], values[:, :, rows], sees,
                                               k[:, :, block], v[:, :, block], size)
                              for block, rows, sees in groups], dim=2)

        positions = (pos[:, None] + torch.arange(size, device=pos.device)).flatten()
        hidden = drafter.run_block(drafter.block_tokens(batch.token(0)[anchors]), positions, attention)
        return hidden.view(len(anchors), size, -1)

    def __call__(self, batch: Packed) -> tuple[torch.Tensor, dict[str, float]]:
        drafter, size = self.drafter, self.drafter.block_size
        candidates = (batch.response_label(1) & (batch.local >= 1)).nonzero().squeeze(1).cpu()
        # evaluation (no gradients) draws the same anchors of a batch every time, so figures compare across evaluations
        generator = self.generator if torch.is_grad_enabled() else torch.Generator().manual_seed(0)
        anchors = candidates[torch.randperm(len(candidates), generator=generator)[: self.anchors]].sort().values
        anchors = anchors.to(batch.local.device)
        count = len(anchors)
        hidden = self.blocks(batch, anchors)
        losses, sums = [], {}
        right = torch.zeros(count, self.steps, dtype=torch.bool, device=anchors.device)
        full = torch.ones(count, dtype=torch.bool, device=anchors.device)
        self.to_draft = self.to_draft.to(hidden.device)
        for k in range(1, size):
            labels, labelled = self.to_draft[batch.token(k)[anchors]], batch.response_label(k)[anchors]
            rows = (labelled & (labels >= 0)).nonzero().squeeze(1)  # labels the draft vocabulary holds
            logits = drafter.logits(hidden[rows, k]).float()
            losses.append(F.cross_entropy(logits, labels[rows]) if len(rows) else logits.sum() * 0)
            ranks = self.ranks(logits.detach(), labels[rows])
            self.add_ranks(sums, k - 1, ranks, int(labelled.sum()))
            right[rows, k - 1] = ranks == 0
            full &= labelled
        weights = self.weights.to(hidden.device)
        total = (torch.stack(losses) * weights).sum() / weights.sum()
        leading = right[full].long().cumprod(1).sum(1)
        sums.update(accepted=float(leading.sum()), chains=float(len(leading)), loss=float(total.detach()), batches=1.0)
        return total, sums


def _block_attention(q: torch.Tensor, context_keys: torch.Tensor, context_values: torch.Tensor, sees: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """Attention of block rows q [1, heads, m, d] (m / size blocks) over the context rows they see
    (`sees` [m, n] of context keys/values [1, kv_heads, n, d]) and the rows of their own block
    (keys/values [1, kv_heads, m, d]), one softmax over both."""
    heads, rows, dim = q.shape[1], q.shape[2], q.shape[3]
    repeat = heads // context_keys.shape[1]
    context_keys, context_values = context_keys.repeat_interleave(repeat, 1), context_values.repeat_interleave(repeat, 1)
    keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    scale = dim ** -0.5
    outer = (q @ context_keys.transpose(-1, -2) * scale).masked_fill(~sees[None, None], float("-inf"))
    blocks = q.view(1, heads, rows // size, size, dim)
    inner = blocks @ keys.view(1, heads, rows // size, size, dim).transpose(-1, -2) * scale
    weights = torch.cat([outer, inner.reshape(1, heads, rows, size)], dim=-1).softmax(-1)
    own = weights[..., outer.shape[-1]:].reshape(1, heads, rows // size, size, size)
    return weights[..., :outer.shape[-1]] @ context_values + (own @ values.view(blocks.shape)).reshape(q.shape)
