"""Our Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2).

It runs a packed batch: the new tokens of several sequences laid end to end, each sequence
attending to its own KV-cache slot under its own mask, which is what tree verification and
continuous batching need and what transformers' model code does not expose. Parameter names match
Hugging Face checkpoints so state dicts load as they are.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.model.attention import AttentionBackend, get_backend
from actors.model.config import DecoderConfig
from actors.model.kv_cache import KVCache
from actors.model.sharding import Communicator, ShardPlan


@dataclass
class Segment:
    """The new tokens of one sequence inside a packed forward pass.

    They are written to cache positions [start, start + num_tokens) of `slot` and attend to
    positions [0, start + num_tokens) under `mask` ([num_tokens, start + num_tokens], True = may
    attend), or to all of them when mask is None.
    """

    slot: int
    start: int
    num_tokens: int
    mask: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        inv_freq, self.scaling = config.rope_inverse_frequencies()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self.scaling).to(dtype), (angles.sin() * self.scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, plan: ShardPlan):
        super().__init__()
        q0, q1 = plan.q_heads(config)
        k0, k1 = plan.kv_heads(config)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, config.head_dim
        hidden, bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin, layer, segments, cache: KVCache, backend: AttentionBackend):
        tokens = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        outputs, start = [], 0
        for segment in segments:
            end = start + segment.num_tokens
            slot, first = segment.slot, segment.start
            cache.write(layer, slot, first, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1))
            keys, values = cache.read(layer, slot, first + segment.num_tokens)
            out = backend.attend(q[start:end].transpose(0, 1), keys, values, segment.mask)
            outputs.append(out.transpose(0, 1).reshape(segment.num_tokens, -1))
            start = end
        return self.o_proj(torch.cat(outputs) if len(outputs) > 1 else outputs[0])


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig, plan: ShardPlan):
        super().__init__()
        start, end = plan.intermediate(config)
        self.gate_proj = nn.Linear(config.hidden_size, end - start, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, end - start, bias=False)
        self.down_proj = nn.Linear(end - start, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, plan: ShardPlan):
        super().__init__()
        self.self_attn = Attention(config, plan)
        self.mlp = MLP(config, plan)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Backbone(nn.Module):
    """Named `model` inside LlamaDecoder so parameter names match Hugging Face checkpoints."""

    def __init__(self, config: DecoderConfig, plan: ShardPlan):
        super().__init__()
        v0, v1 = plan.vocab(config)
        self.embed_tokens = nn.Embedding(v1 - v0, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, plan) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaDecoder(nn.Module):
    def __init__(
        self,
        config: DecoderConfig,
        plan: ShardPlan = ShardPlan(),
        comm: Communicator | None = None,
        attention_backend: str = "sdpa",
    ):
        super().__init__()
        plan.validate(config)
        self.config, self.plan = config, plan
        self.comm = comm or Communicator()
        self.backend = get_backend(attention_backend)
        self.vocab_start, self.vocab_end = plan.vocab(config)
        self.model = Backbone(config, plan)
        self.rotary = RotaryEmbedding(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, self.vocab_end - self.vocab_start, bias=False)
        self.requires_grad_(False)  # an inference engine; trained heads live in speculators/train

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        attn = self.model.layers[0].self_attn
        return KVCache(self.num_layers, num_slots, max_len, attn.num_kv_heads, attn.head_dim, self.dtype, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self.model.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_end - self.vocab_start)
        hidden = self.model.embed_tokens(local.clamp(0, self.vocab_end - self.vocab_start - 1))
        return self.comm.all_reduce(hidden * inside[:, None].to(hidden.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of final hidden states (gathered across ranks)."""
        return self.comm.all_gather_last_dim(F.linear(hidden, self.head_weight()))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        segments: list[Segment],
        cache: KVCache,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run the packed new tokens of `segments`, writing their K/V into `cache`.

        Returns the normed final hidden states of `logit_rows` (indices into the packed tokens),
        or None when no row is asked for (a prefill skips the last MLP and the LM head).
        """
        for segment in segments:
            cache.check_room(segment.start + segment.num_tokens)
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        last = len(self.model.layers) - 1
        for index, layer in enumerate(self.model.layers):
            attn_in = layer.input_layernorm(hidden)
            attn_out = layer.self_attn(attn_in, cos, sin, index, segments, cache, self.backend)
            hidden = hidden + self.comm.all_reduce(attn_out)
            if index == last and logit_rows is not None:
                hidden = hidden.index_select(0, logit_rows)
            elif index == last:
                return None
            hidden = hidden + self.comm.all_reduce(layer.mlp(layer.post_attention_layernorm(hidden)))
        return self.model.norm(hidden)


def decoder_from_tensors(
    config: DecoderConfig,
    tensors: dict[str, torch.Tensor],
    plan: ShardPlan = ShardPlan(),
    comm: Communicator | None = None,
    attention_backend: str = "sdpa",
    source: str = "checkpoint",
) -> LlamaDecoder:
    """A decoder whose parameters are the given tensors themselves (no copy): how checkpoints are
    loaded and how a self-draft shares its target's weights. Extra tensors are ignored."""
    with torch.device("meta"):
        model = LlamaDecoder(config, plan, comm, attention_backend)
    expected = {name for name, _ in model.named_parameters()}
    missing = expected - set(tensors)
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    model.load_state_dict({name: tensors[name] for name in expected}, strict=False, assign=True)
    model.rotary = RotaryEmbedding(config).to(model.device)  # its buffers were created on meta
    return model


def layer_skip_config(config: DecoderConfig, num_layers: int) -> DecoderConfig:
    """The config of a self-draft made of a target's first `num_layers` layers."""
    if not 0 < num_layers < config.num_layers:
        raise ValueError(f"layer-skip draft needs 1..{config.num_layers - 1} layers, got {num_layers}")
    return dataclasses.replace(config, num_layers=num_layers)


def layer_skip_draft(target: LlamaDecoder, num_layers: int) -> LlamaDecoder:
    """A self-draft: the target's first `num_layers` layers, its final norm and its LM head.

    The weights are shared with the target (no extra memory); the draft keeps its own KV cache.
    """
    return decoder_from_tensors(layer_skip_config(target.config, num_layers), dict(target.named_parameters()),
                                target.plan, target.comm, target.backend.name)
