"""Our Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2).

It runs a packed batch: the new tokens of several sequences laid end to end, each sequence
attending to its own KV-cache blocks under its own mask, which is what tree verification and
continuous batching need and what transformers' model code does not expose. Parameter names match
Hugging Face checkpoints so state dicts load as they are.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from actors.model import fused_ops
from actors.model.attention import AttentionBackend, get_backend
from actors.model.batch import PackedBatch, Segment
from actors.model.config import DecoderConfig
from actors.model.fused import JointProjection, stack_in_place
from actors.model.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from actors.model.projection import Projection, project
from actors.model.sharding import Communicator, ShardPlan
from actors.model.split_attention import SplitBackend


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
        self.q_proj = Projection(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Projection(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Projection(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Projection(self.num_heads * self.head_dim, hidden, bias=False)
        self.qkv = JointProjection((self.q_proj, self.k_proj, self.v_proj), project)

    def forward(self, x, cos, sin, layer: int, batch: PackedBatch, cache: KVCache, backend: AttentionBackend):
        """x [tokens, hidden], cos/sin [tokens, head_dim] -> [tokens, hidden] (this rank's heads' part,
        which the decoder all-reduces)."""
        tokens = x.shape[0]
        joint = self.qkv.joint(x) if fused_ops.fused(x) else None
        if joint is not None:  # rotation and the K/V write in one pass (cos/sin in float32)
            q = torch.ops.specserve.rotary_and_write(joint.contiguous(), cos, sin, cache.keys[layer], cache.values[layer],
                                                     batch.token_storage, self.num_heads, self.num_kv_heads)
            return self.o_proj(backend.attend(q, batch, cache, layer))
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q, k, v = self.qkv(x)
        q = apply_rotary(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        batch.write(cache, layer, k, v)
        return self.o_proj(backend.attend(q, batch, cache, layer))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig, plan: ShardPlan):
        super().__init__()
        start, end = plan.intermediate(config)
        self.gate_proj = Projection(config.hidden_size, end - start, bias=False)
        self.up_proj = Projection(config.hidden_size, end - start, bias=False)
        self.down_proj = Projection(end - start, config.hidden_size, bias=False)
        self.gate_up = JointProjection((self.gate_proj, self.up_proj), project)

    def forward(self, x):
        joint = self.gate_up.joint(x)
        if joint is not None:
            return self.down_proj(fused_ops.silu_and_mul(joint, self.gate_proj.out_features))
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


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
            self.lm_head = Projection(config.hidden_size, self.vocab_end - self.vocab_start, bias=False)
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

    def products(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of every product a pass makes, as `project` gets them."""
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            yield from attention.qkv.products()
            yield attention.o_proj.weight, attention.o_proj.bias
            yield from mlp.gate_up.products()
            yield mlp.down_proj.weight, mlp.down_proj.bias
        yield self.head_weight(), None

    def new_cache(self, num_blocks: int, max_len: int, block_size: int = DEFAULT_BLOCK_SIZE) -> KVCache:
        attn = self.model.layers[0].self_attn
        return KVCache(self.num_layers, num_blocks, block_size, max_len, attn.num_kv_heads, attn.head_dim, self.dtype,
                       self.device)

    def kv_bytes_per_position(self) -> int:
        """KV cache bytes one position of one sequence takes (this rank's heads)."""
        attn = self.model.layers[0].self_attn
        return KVCache.bytes_per_position(self.num_layers, attn.num_kv_heads, attn.head_dim, self.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self.model.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_end - self.vocab_start)
        hidden = self.model.embed_tokens(local.clamp(0, self.vocab_end - self.vocab_start - 1))
        return self.comm.all_reduce(hidden * inside[:, None].to(hidden.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [rows, vocab] of final hidden states [rows, hidden] (gathered across ranks)."""
        return self.comm.all_gather_last_dim(project(hidden, self.head_weight()))

    def likeliest(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each final hidden state ([rows, hidden] -> [rows]), as
        `logits(hidden).argmax(-1)` gives it (the first of equal maxima), with only each rank's best
        (value, token) gathered across ranks."""
        local = project(hidden, self.head_weight())
        if self.comm.world_size == 1:
            return local.max(-1).indices  # argmax's index (the first of equal maxima, a NaN first); bfloat16
            # rows of 49,152: 2.2x faster than widening to float32 for argmax, 4.7x than bfloat16's argmax
        values, tokens = local.max(-1)
        gathered = self.comm.all_gather(torch.stack([values.float(), (tokens + self.vocab_start).float()]))
        values, tokens = torch.stack([g[0] for g in gathered]), torch.stack([g[1] for g in gathered])
        return tokens.gather(0, values.argmax(0, keepdim=True))[0].long()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        segments: list[Segment],
        cache: KVCache,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run the packed new tokens of `segments`, writing their K/V into `cache`.

        `input_ids` and `positions` [tokens]: the segments' new tokens end to end, and each one's
        position in its sequence. Returns the normed final hidden states [len(logit_rows), hidden] of
        `logit_rows` (indices into the packed tokens), or None when no row is asked for (a prefill
        skips the last MLP and the LM head).
        """
        return self.forward_capturing(input_ids, positions, segments, cache, logit_rows)[0]

    @torch.inference_mode()
    def forward_capturing(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        segments: list[Segment],
        cache: KVCache,
        logit_rows: torch.Tensor | None = None,
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`forward`, also returning the hidden states a trained head reads, for every packed token.

        `capture` lists layers as Hugging Face's `hidden_states` numbers them (and vLLM's EAGLE-3
        `eagle_aux_hidden_state_layer_ids`): i < num_layers is the residual stream entering layer i,
        num_layers the normed final output. The captured rows are concatenated in that order:
        [tokens, len(capture) x hidden]; None when nothing is captured.
        """
        for segment in segments:
            cache.check_room(segment.end)
        return self.run_capturing(input_ids, positions, PackedBatch(segments, self.device, cache), cache, logit_rows,
                                  capture)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: PackedBatch,
        cache: KVCache,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """`forward` over a layout already built: device work only, so a CUDA graph can capture it."""
        return self.run_capturing(input_ids, positions, batch, cache, logit_rows)[0]

    @torch.inference_mode()
    def run_capturing(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: PackedBatch,
        cache: KVCache,
        logit_rows: torch.Tensor | None = None,
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`forward_capturing` over a layout already built."""
        hidden = self.embed(input_ids)
        # float32 where the rotation is fused (attention casts them otherwise)
        cos, sin = self.rotary(positions, torch.float32 if fused_ops.fused(hidden) else hidden.dtype)
        layers = self.model.layers
        last = len(layers) - 1
        captured: dict[int, torch.Tensor] = {}
        final_wanted = last + 1 in capture
        hidden, attn_in = fused_ops.add_rms_norm(hidden, None, layers[0].input_layernorm)
        for index, layer in enumerate(layers):
            if index in capture:
                captured[index] = hidden
            attn_out = layer.self_attn(attn_in, cos, sin, index, batch, cache, self.backend)
            if index == last and logit_rows is None and not final_wanted:
                return None, _joined(captured, capture)
            hidden, mlp_in = fused_ops.add_rms_norm(hidden, self.comm.all_reduce(attn_out), layer.post_attention_layernorm)
            if index == last and logit_rows is not None and not final_wanted:  # the norm is per row
                hidden, mlp_in = hidden.index_select(0, logit_rows), mlp_in.index_select(0, logit_rows)
            following = layers[index + 1].input_layernorm if index < last else self.model.norm
            hidden, attn_in = fused_ops.add_rms_norm(hidden, self.comm.all_reduce(layer.mlp(mlp_in)), following)
        hidden = attn_in  # the final norm's output
        if final_wanted:
            captured[last + 1] = hidden
            hidden = None if logit_rows is None else hidden.index_select(0, logit_rows)
        return hidden, _joined(captured, capture)


def _joined(captured: dict[int, torch.Tensor], order: Sequence[int]) -> torch.Tensor | None:
    return torch.cat([captured[layer] for layer in order], dim=-1) if order else None


def decoder_from_tensors(
    config: DecoderConfig,
    tensors: dict[str, torch.Tensor],
    plan: ShardPlan = ShardPlan(),
    comm: Communicator | None = None,
    attention_backend: str = "sdpa",
    source: str = "checkpoint",
) -> LlamaDecoder:
    """A decoder whose parameters are the given tensors themselves (no copy): how checkpoints are
    loaded and how a self-draft shares its target's weights. Extra tensors are ignored. Each
    layer's q/k/v and gate/up tensors are first stacked, so that each group runs as one product:
    their entries in `tensors` become views of the stacked tensor (fused.py)."""
    with torch.device("meta"):
        model = LlamaDecoder(config, plan, comm, attention_backend)
    expected = {name for name, _ in model.named_parameters()}
    missing = expected - set(tensors)
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}."
        for module, group in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            for kind in ("weight", "bias"):
                names = [f"{prefix}{module}.{name}.{kind}" for name in group]
                if all(name in expected for name in names):
                    stack_in_place(tensors, names)
    model.load_state_dict({name: tensors[name] for name in expected}, strict=False, assign=True)
    model.rotary = RotaryEmbedding(config).to(model.device)  # its buffers were created on meta
    if isinstance(model.backend, SplitBackend):
        model.backend.check_dtype(model.dtype)
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
