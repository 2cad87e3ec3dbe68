"""Random-weight Llama-family models for the GPU check, built on the device itself.

No real weights can reach the GPU machine, and a speed or correctness check needs only the shapes:
the 1B and 8B classes are Llama-3.2-1B's and Llama-3.1-8B's dimensions (plain RoPE; the Llama-3
frequency scaling changes no cost), the draft is two layers as wide as the 1B class. The dry run
uses tiny shapes of the same structure. Weights are drawn by transformers' own initialisation
into a LlamaForCausalLM, and our decoder is built on the very same tensors (no copy), so a logits
comparison between the two compares code, not weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.model.config import DecoderConfig
from actors.model.llama import LlamaDecoder, decoder_from_tensors


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool

    def hf_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=8192, rope_theta=500000.0,
            tie_word_embeddings=self.tie_word_embeddings, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        )

    def parameters(self) -> int:
        attention = self.hidden_size * self.hidden_size * 2 * (1 + self.num_kv_heads / self.num_heads)
        per_layer = attention + 3 * self.hidden_size * self.intermediate_size
        heads = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return int(self.num_layers * per_layer + heads)


GPU_SHAPES = {
    "1b": Shape(name="llama-3.2-1b-class", hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                vocab_size=128256, tie_word_embeddings=True),
    "8b": Shape(name="llama-3.1-8b-class", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                vocab_size=128256, tie_word_embeddings=False),
    "draft": Shape(name="2-layer draft, 1b-class width", hidden_size=2048, intermediate_size=8192, num_layers=2, num_heads=32,
                   num_kv_heads=8, vocab_size=128256, tie_word_embeddings=True),
}
CPU_SHAPES = {
    "1b": Shape(name="tiny (dry run)", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                vocab_size=256, tie_word_embeddings=True),
    "8b": Shape(name="tiny, deeper (dry run)", hidden_size=96, intermediate_size=192, num_layers=4, num_heads=4, num_kv_heads=2,
                vocab_size=256, tie_word_embeddings=False),
    "draft": Shape(name="tiny 1-layer draft (dry run)", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                   num_kv_heads=2, vocab_size=256, tie_word_embeddings=True),
}


@dataclass
class RandomModel:
    shape: Shape
    reference: LlamaForCausalLM
    decoder: LlamaDecoder


def build(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0,
          attention_backend: str = "sdpa") -> RandomModel:
    """transformers' model with fresh random weights on `device`, and our decoder over the same tensors."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            reference = LlamaForCausalLM(shape.hf_config()).eval()
    finally:
        torch.set_default_dtype(previous)
    reference.requires_grad_(False)
    decoder = decoder_from_tensors(DecoderConfig.from_hf(reference.config), dict(reference.named_parameters()),
                                   attention_backend=attention_backend, source=shape.name)
    return RandomModel(shape, reference, decoder)


def save(model: RandomModel, directory: Path) -> Path:
    """A Hugging Face directory (config.json + safetensors) of the model, for code that loads by path."""
    model.reference.save_pretrained(directory)
    return directory
