"""The few numbers our decoder needs, read from a Hugging Face config of the Llama family."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    hf_config: PretrainedConfig

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> "DecoderConfig":
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not a Llama-family decoder; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (SwiGLU needs silu)")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            max_position_embeddings=config.max_position_embeddings,
            eos_token_ids=eos_ids,
            hf_config=config,
        )

    def rope_inverse_frequencies(self) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention_scaling) exactly as transformers computes them for this config.

        Reusing transformers' rotary module keeps every RoPE variant it knows (default, linear,
        llama3, yarn, longrope) correct without a copy of its formulas here.
        """
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope_type = _rope_type(self.hf_config)
        if rope_type == "dynamic":
            raise ValueError("dynamic NTK RoPE changes with sequence length and is not supported")
        rotary = LlamaRotaryEmbedding(self.hf_config)
        return rotary.inv_freq.float(), float(rotary.attention_scaling)


def _rope_type(config: PretrainedConfig) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))
