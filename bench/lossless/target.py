"""The tiny target the losslessness harness samples, and its exact distribution over whole sequences.

A vocabulary of 12 keeps every sequence of 4 new tokens countable (12^4 cells), so the engine's
samples are compared with the target's own probabilities rather than with another sampler. The
models are random Llamas written as Hugging Face directories with a word-level tokenizer, because
Ray actors (tensor-parallel shards, draft actors) load their model by path. The reference runs the
transformers implementation in float64 on plain causal sequences: no tree masks, no KV cache, no
packing, none of the engine's machinery.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, RepetitionPenaltyLogitsProcessor

from bench.lossless.cases import LONG_PROMPT, PROMPT, SHORT_PROMPT
from bench.lossless.heads import write_dflash, write_eagle3, write_medusa
from speculators.datastore import tokenizer_fingerprint, write_datastore
from speculators.penalties import Penalties
from speculators.sampling import SamplingParams, warp

VOCAB = 12
TARGET_SEED, DRAFT_SEED = 0, 1
INITIALIZER_RANGE = 0.3
"""Wide enough that conditionals differ from prefix to prefix and top-k / top-p cut real mass."""
CORPUS_PROMPTS = (PROMPT, SHORT_PROMPT, LONG_PROMPT)
CORPUS_SAMPLES, CORPUS_TOKENS, CORPUS_SEED = 64, 8, 2


def tiny_llama(seed: int, num_layers: int) -> LlamaForCausalLM:
    """A random float64 Llama over VOCAB tokens, 2 KV heads (so it splits over 2 ranks)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False, initializer_range=INITIALIZER_RANGE,
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()


def save_with_tokenizer(model: LlamaForCausalLM, path: Path) -> Path:
    """A Hugging Face directory: the weights and a tokenizer whose token i reads 't<i>'."""
    model.save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(path)
    return path


@dataclass
class TinyModels:
    """The target (2 layers; its first layer is the layer-skip draft), a separate 1-layer draft,
    random EAGLE-3 and Medusa heads for the target (heads.py), and a REST datastore."""

    root: Path

    @cached_property
    def reference(self) -> LlamaForCausalLM:
        return tiny_llama(TARGET_SEED, num_layers=2)

    @cached_property
    def target_dir(self) -> Path:
        return save_with_tokenizer(self.reference, self.root / "target")

    @cached_property
    def draft_dir(self) -> Path:
        return save_with_tokenizer(tiny_llama(DRAFT_SEED, num_layers=1), self.root / "draft")

    @cached_property
    def eagle3_dir(self) -> Path:
        return write_eagle3(self.reference.config, self.root / "eagle3")

    @cached_property
    def medusa_dir(self) -> Path:
        return write_medusa(self.reference.config, self.root / "medusa")

    @cached_property
    def dflash_dir(self) -> Path:
        return write_dflash(self.reference.config, self.root / "dflash")

    @cached_property
    def rest_datastore_dir(self) -> Path:
        """A REST datastore of the target's own samples after the cases' prompts (CORPUS_SAMPLES
        each), so that its drafts are often right and often wrong: both ways the verifier is tried."""
        torch.manual_seed(CORPUS_SEED)
        documents = []
        for prompt in CORPUS_PROMPTS:
            with torch.no_grad():
                samples = self.reference.generate(torch.tensor([prompt]).expand(CORPUS_SAMPLES, -1), do_sample=True,
                                                  max_new_tokens=CORPUS_TOKENS, min_new_tokens=CORPUS_TOKENS, top_k=0)
            documents += samples.tolist()
        fingerprint = tokenizer_fingerprint(PreTrainedTokenizerFast.from_pretrained(self.target_dir))
        write_datastore(self.root / "rest", documents, fingerprint, VOCAB, model=str(self.target_dir))
        return self.root / "rest"

    def distribution(self, prompt: tuple[int, ...], sampling: SamplingParams, new_tokens: int,
                     penalties: Penalties | None = None, rule: TokenRule | None = None) -> SequenceDistribution:
        return sequence_distribution(self.reference, prompt, sampling, new_tokens, penalties, rule)


@dataclass
class SequenceDistribution:
    """P(x_1..x_L | prompt) of the target with its sampling warp, from its own conditionals.

    `conditionals[t]` has shape (V,) * t + (V,): the next-token distribution after each prefix of
    t new tokens. The chain rule multiplies them into `joint`, shape (V,) * L.
    """

    conditionals: list[np.ndarray]

    @property
    def new_tokens(self) -> int:
        return len(self.conditionals)

    @cached_property
    def joint(self) -> np.ndarray:
        return self.prefix_probabilities(self.new_tokens)

    def prefix_probabilities(self, depth: int) -> np.ndarray:
        """P(x_1..x_depth), shape (V,) * depth, by the chain rule (so the empty prefix has exactly 1)."""
        probabilities = np.ones(())
        for conditional in self.conditionals[:depth]:
            probabilities = probabilities[..., None] * conditional
        return probabilities


def sequence_distribution(
    model: LlamaForCausalLM, prompt: tuple[int, ...], sampling: SamplingParams, new_tokens: int,
    penalties: Penalties | None = None, rule: TokenRule | None = None,
) -> SequenceDistribution:
    """One causal forward over every prompt + (L - 1)-token continuation gives every conditional;
    each is penalised, masked by the rule and warped as the request's features define (penalties on
    raw logits, then the grammar's mask, then temperature, top-k and top-p)."""
    vocab = model.config.vocab_size
    continuations = torch.tensor(list(itertools.product(range(vocab), repeat=new_tokens - 1))).reshape(-1, new_tokens - 1)
    inputs = torch.cat([torch.tensor(prompt).expand(len(continuations), -1), continuations], dim=1)
    with torch.no_grad():
        logits = model(inputs).logits[:, len(prompt) - 1:]  # [V^(L-1), L, V]
    if penalties is not None:
        logits = _penalised(logits, inputs, len(prompt), penalties)
    if rule is not None:
        for position in range(new_tokens):
            banned = torch.ones(vocab, dtype=torch.bool)
            banned[list(rule.allowed(position))] = False
            logits[:, position, banned] = float("-inf")
    probs = warp(logits, sampling).double().numpy().reshape((vocab,) * (new_tokens - 1) + (new_tokens, vocab))
    # the conditional after x_1..x_t is the same whatever follows x_t: read it where they are all 0
    return SequenceDistribution([
        probs[(slice(None),) * depth + (0,) * (new_tokens - 1 - depth) + (depth,)] for depth in range(new_tokens)
    ])


class TokenRule(Protocol):
    """A grammar as the reference applies it: the tokens allowed at each output position."""

    def allowed(self, position: int) -> tuple[int, ...]: ...


def _penalised(logits: torch.Tensor, inputs: torch.Tensor, prompt_length: int, penalties: Penalties) -> torch.Tensor:
    """Every position's logits penalised for the sequence before it: transformers' repetition
    penalty over prompt and output, then OpenAI's frequency and presence penalties over the output."""
    logits = logits.clone()
    outputs = inputs[:, prompt_length:]
    for position in range(logits.shape[1]):
        if penalties.repetition != 1:
            processor = RepetitionPenaltyLogitsProcessor(penalties.repetition)
            logits[:, position] = processor(inputs[:, :prompt_length + position], logits[:, position])
        counts = torch.nn.functional.one_hot(outputs[:, :position], logits.shape[-1]).sum(1).to(logits.dtype)
        logits[:, position] -= penalties.frequency * counts + penalties.presence * (counts > 0).to(logits.dtype)
    return logits
