"""Medusa heads: K residual blocks on the target's last hidden state, head k guessing token t + k + 2.

Head k is `lm_head_k(h + SiLU(W_k h + b_k))` over the target's normed final hidden state h of the
last committed token t (the target's own LM head already gave t + 1, the tree's root). Parameter
names follow vLLM's Medusa format (`blocks.{k}.layers.{j}`, `lm_heads.{k}`, optional `token_map`
for a truncated vocabulary); one LM head shared by all heads (`original_lm_head`) is supported,
which is how heads trained here stay small.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 draft_vocab_size: int | None = None, shared_lm_head: bool = False, bias: bool = True):
        super().__init__()
        self.hidden_size, self.vocab_size, self.num_heads = hidden_size, vocab_size, num_heads
        self.draft_vocab_size = draft_vocab_size or vocab_size
        self.shared_lm_head = shared_lm_head
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers, bias) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, self.draft_vocab_size, bias=False)
                                      for _ in range(1 if shared_lm_head else num_heads))
        self.register_buffer("token_map", torch.arange(self.draft_vocab_size))
        """Target token id of each draft token id (the identity for a full vocabulary)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [num_heads, n, draft_vocab] of hidden states [n, H]."""
        return torch.stack([self.lm_heads[0 if self.shared_lm_head else k](block(hidden))
                            for k, block in enumerate(self.blocks)])
