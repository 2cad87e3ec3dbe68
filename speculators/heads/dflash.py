"""DFlash block drafters: one forward pass drafts a whole block of tokens from the target's hidden states.

How it drafts. The target's hidden states of the committed tokens at `target_layer_ids` (layer
outputs), concatenated, become context features `hidden_norm(fc(h))`. Every layer projects those
same features to keys and values (its own k/v projections, k norm, rotary at their positions);
they never change once computed, so a request keeps them like a KV cache. A block is the last
committed token followed by `block_size - 1` mask tokens, embedded with the target's embedding, at
the next positions. Every block row attends to all context rows and to every block row (no causal
mask inside the block), and block row k's output, through the final norm and the target's LM head,
is the drafter's distribution of the token k places after the last committed one: all positions
from one pass, where an EAGLE head runs once per drafted depth.

The layout is z-lab's published one (which vLLM and SGLang serve): a Qwen3-style config with
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and `dflash_config:
{mask_token_id, target_layer_ids}`; tensors `fc.weight` [H, len(ids) x Ht], `hidden_norm.weight`,
`layers.{i}.{input_layernorm,post_attention_layernorm}.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`layers.{i}.self_attn.{q,k}_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`, `norm.weight`.
The drafter owns no embedding and no LM head: it uses the target's (`share_target`).

One extension of that layout, for targets whose LM head costs as much to read as a good part of
the target (on a CPU, where a pass is memory-bound: SmolLM2-135M's 49,152 x 576 head is a fifth of
its weights): a drafter may score only a draft vocabulary of the target's most frequent output
tokens (FR-Spec, as EAGLE-3 heads do) with an LM head of its own, `lm_head.weight` [Vd, H] and
`d2t` (target id = draft id + d2t[draft id]) beside `draft_vocab_size` in the config. Verification
stays over the whole vocabulary, so output is unchanged; a token outside the draft vocabulary is
never drafted.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.llama.modeling_llama import rotate_half
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer index, block queries [1, heads, m, d], block keys, values [1, kv_heads, m, d]) -> attention
output [1, heads, m, d]: the caller adds the context rows each block row may see (serving: a request's
cached context; training: a packed batch's, under a mask)."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [1, heads, n, d] at the positions cos/sin [1, n, d] were made for."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class BlockAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(config.attention_bias)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        return x.view(x.shape[0], count, self.head_dim).transpose(0, 1)[None]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [1, kv_heads, n, d] of n rows."""
        keys = rotate(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return keys, self._heads(self.v_proj(x), self.num_kv_heads)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)


class BlockLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)


class DFlashDrafter(nn.Module):
    embed_tokens = None
    """Never its own: the target's embedding embeds the block."""

    def __init__(self, config: Qwen3Config, target_layer_ids: Sequence[int], block_size: int, mask_token_id: int,
                 target_hidden_size: int | None = None, output_multiplier: float = 1.0, logit_softcap: float | None = None,
                 tree_choices: list[list[int]] | None = None, draft_vocab_size: int | None = None):
        """`config`: the drafter's layers (Qwen3-style) with the target's vocabulary; `target_layer_ids`:
        the target layers whose outputs it reads; `tree_choices`: the static tree it drafts (rank
        paths, as Medusa's), chosen at training time; None: a chain. `draft_vocab_size`: an LM head
        of its own over that many tokens (set with `set_vocabulary`); None: the target's."""
        super().__init__()
        if block_size < 2:
            raise ValueError("a DFlash block holds the last committed token and at least one mask token: block_size >= 2")
        self.config, self.block_size, self.mask_token_id = config, block_size, mask_token_id
        self.target_layer_ids = tuple(target_layer_ids)
        self.target_hidden_size = target_hidden_size or config.hidden_size
        self.output_multiplier, self.logit_softcap = output_multiplier, logit_softcap
        self.tree_choices = tree_choices
        self.fc = nn.Linear(len(self.target_layer_ids) * self.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)
        self._embedding: torch.Tensor | None = None
        self.draft_vocab_size = draft_vocab_size
        self.lm_head: nn.Linear | None = None
        """Its own over the draft vocabulary, or the target's (`share_target`: a module so that the
        runtime computes it like its own linear layers, a packed copy on a CPU; never saved)."""
        if draft_vocab_size is not None:
            self.lm_head = nn.Linear(config.hidden_size, draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))

    @property
    def needs_target_lm_head(self) -> bool:
        return self.draft_vocab_size is None

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of each row of its logits."""
        ids = torch.arange(self.draft_vocab_size or self.config.vocab_size, device=self.fc.weight.device)
        return ids if self.draft_vocab_size is None else ids + self.d2t

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: target ids in draft order."""
        self.d2t.copy_(target_ids.to(self.d2t.device) - torch.arange(len(target_ids), device=self.d2t.device))

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target hidden states read, numbered as Hugging Face's `hidden_states` (layer l's output is l + 1)."""
        return tuple(layer + 1 for layer in self.target_layer_ids)

    def share_target(self, embedding: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """Use the target's embedding (and LM head, without a draft vocabulary), not copied where the dtypes agree."""
        self._embedding = embedding
        if not self.needs_target_lm_head:
            return
        if lm_head is None:
            raise ValueError("a DFlash drafter without a draft vocabulary scores tokens with the target's LM head: pass it")
        self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, device="meta")
        self.lm_head.weight = nn.Parameter(lm_head.to(self.fc.weight.dtype), requires_grad=False)

    def own_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds: every tensor but the target's LM head."""
        shared = self.needs_target_lm_head
        return {name: t for name, t in self.state_dict().items() if not (shared and name.startswith("lm_head."))}

    # ---- the computation, in pieces that serving and training assemble ------------------------

    def context(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values [1, kv_heads, n, d] of n committed rows from the target's
        hidden states [n, len(ids) x Ht] at `positions` [n]."""
        features = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary(features, positions[None])
        return [layer.self_attn.keys_values(features, cos, sin) for layer in self.layers]

    def block_tokens(self, roots: torch.Tensor) -> torch.Tensor:
        """[len(roots) x block_size] token ids: each root followed by the mask tokens."""
        blocks = torch.full((len(roots), self.block_size), self.mask_token_id, dtype=torch.long, device=roots.device)
        blocks[:, 0] = roots
        return blocks.flatten()

    def run_block(self, tokens: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Outputs [m, H] (before the final norm) of block rows `tokens` at `positions`."""
        embedding = self._embedding
        if embedding is None:
            raise RuntimeError("a DFlash drafter uses the target's embedding and LM head: call share_target first")
        with torch.autocast(embedding.device.type, enabled=False):  # a lookup: never cast the whole table
            x = nn.functional.embedding(tokens, embedding)
        x = x.to(self.fc.weight.dtype)
        cos, sin = self.rotary(x, positions[None])
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            normed = layer.input_layernorm(x)
            keys, values = attn.keys_values(normed, cos, sin)
            out = attention(index, attn.queries(normed, cos, sin), keys, values)
            x = x + attn.o_proj(out[0].transpose(0, 1).reshape(x.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of block outputs over its vocabulary (`draft_to_target` maps them)."""
        logits = self.lm_head(self.norm(hidden)) * self.output_multiplier
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits
