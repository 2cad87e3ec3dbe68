"""EAGLE heads: one decoder layer that drafts from the target's hidden states.

One row of the head pairs a feature with the embedding of the next token: the row at position i
reads the target's feature of token i and the token at i + 1, and predicts the token at i + 2.
For committed tokens the feature comes from the target; past the last committed token it is the
head's own output for the row before (how EAGLE drafts several tokens ahead).

- EAGLE-3 (`version=3`): the target's feature is `fc(concat of three layers' hidden states)`; the
  layer normalizes the embedding (`input_layernorm`) and the feature (`hidden_norm`) separately and
  attends over their concatenation (q/k/v projections take 2H); its own LM head scores a draft
  vocabulary (the most frequent tokens, FR-Spec) mapped to the target's by `d2t`.
- EAGLE-1/2 (`version=1`): the feature is the target's normed final hidden state;
  `fc(concat(embedding, feature))` enters a layer without input norm, and the target's own LM head
  scores the output (no final norm), over the full vocabulary.

Parameter names are those of the public checkpoints (vLLM `speculators` for EAGLE-3, the EAGLE
repository for EAGLE-1/2), so state dicts load as they are. The same module serves (one row per
drafted node, against a per-request cache) and trains (whole sequences, speculators/train/).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb


class HeadAttention(nn.Module):
    """Llama attention projections over an input of `input_size` (2H for EAGLE-3)."""

    def __init__(self, config: LlamaConfig, input_size: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)


class HeadLayer(nn.Module):
    def __init__(self, config: LlamaConfig, version: int):
        super().__init__()
        hidden = config.hidden_size
        if version == 3:
            self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = HeadAttention(config, 2 * hidden if version == 3 else hidden)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


class EagleHead(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        version: int = 3,
        target_hidden_size: int | None = None,
        draft_vocab_size: int | None = None,
        aux_layers: tuple[int, ...] = (),
        norm_before_residual: bool = False,
        fc_bias: bool = False,
        own_embedding: bool = False,
    ):
        """`config`: a Llama config of one layer with the target's vocabulary; `aux_layers`: the
        target layers read (three for EAGLE-3, the final output for EAGLE-1/2). Without
        `own_embedding` (and always for EAGLE-1/2's LM head) the target's tensors are attached
        with `share_target`."""
        super().__init__()
        if version not in (1, 3):
            raise ValueError(f"EAGLE version {version} is not supported (1 covers EAGLE-1 and EAGLE-2 checkpoints)")
        hidden = config.hidden_size
        self.config, self.version = config, version
        self.aux_layers, self.norm_before_residual = tuple(aux_layers), norm_before_residual
        self.target_hidden_size = target_hidden_size or hidden
        self.draft_vocab_size = draft_vocab_size or config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        fc_in = 3 * self.target_hidden_size if version == 3 else 2 * hidden
        self.fc = nn.Linear(fc_in, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([HeadLayer(config, version)])
        self.rotary = LlamaRotaryEmbedding(config)
        if version == 3:
            self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.lm_head = None
        self._target_embedding: torch.Tensor | None = None

    # ---- wiring --------------------------------------------------------------------------------

    def share_target(self, embedding: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """Use the target's embedding (and, for EAGLE-1/2, its LM head) without copying them."""
        if self.embed_tokens is None:
            self._target_embedding = embedding
        if self.lm_head is None:
            if lm_head is None:
                raise ValueError("an EAGLE-1/2 head scores tokens with the target's LM head: pass it")
            self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, device="meta")
            self.lm_head.weight = nn.Parameter(lm_head, requires_grad=False)

    @property
    def needs_target_lm_head(self) -> bool:
        return self.version == 1

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of each draft token id."""
        ids = torch.arange(self.draft_vocab_size, device=self.fc.weight.device)
        return ids if self.version == 1 else ids + self.d2t

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: target ids in draft order (d2t offsets, t2d membership)."""
        target_ids = target_ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(target_ids - torch.arange(len(target_ids), device=target_ids.device))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    # ---- the computation, in pieces that serving and training assemble ------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens.weight if self.embed_tokens is not None else self._target_embedding
        if table is None:
            raise RuntimeError("this head shares the target's embedding: call share_target first")
        with torch.autocast(table.device.type, enabled=False):  # a lookup: never cast the whole table
            return F.embedding(token_ids, table)

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Features [n, H] of committed tokens from the target's hidden states [n, len(aux) x Ht]."""
        return self.fc(target_hidden) if self.version == 3 else target_hidden

    def project(self, features: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor):
        """(q [1, heads, n, d], k, v [1, kv_heads, n, d], residual [n, H]) of n rows."""
        layer = self.layers[0]
        embeds = self.embed(token_ids)
        if self.version == 3:
            if self.norm_before_residual:
                features = residual = layer.hidden_norm(features)
            else:
                residual, features = features, layer.hidden_norm(features)
            x = torch.cat([layer.input_layernorm(embeds), features], dim=-1)
        else:
            x = residual = self.fc(torch.cat([embeds, features], dim=-1))
        attn = layer.self_attn
        rows = x.shape[0]
        q = attn.q_proj(x).view(1, rows, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, rows, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, rows, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self.rotary(v, positions.view(1, -1))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's output [n, H] (before any final norm) from attention output [1, heads, n, d]."""
        layer = self.layers[0]
        flat = attended.transpose(1, 2).reshape(attended.shape[2], -1)
        hidden = residual + layer.self_attn.o_proj(flat)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, draft_vocab_size] of layer outputs."""
        return self.lm_head(self.norm(hidden) if self.version == 3 else hidden)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention of q [1, heads, n, d] over keys/values [1, kv_heads, S, d], mask [n, S]."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=None if mask is None else mask[None, None],
                                          enable_gqa=q.shape[1] != keys.shape[1])
