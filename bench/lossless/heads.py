"""Trained-head checkpoints for the harness's tiny target: an EAGLE-3 head, Medusa heads and a DFlash
block drafter with random weights, written in the format the engine serves (and vLLM reads).

Random weights are enough: losslessness must hold whatever a head proposes. Both draft from 9 of
the target's 12 tokens, so the distributions of their sampled drafts give the other 3 nothing,
which verification must handle. They carry their own embedding and LM heads, so they need none of
the target's tensors (the in-process target runs in float64, the heads in the engine's dtype). The
DFlash drafter embeds its block with the target's embedding and scores its own 9 tokens.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, Qwen3Config

from speculators.heads.checkpoint import save_dflash, save_eagle3, save_medusa
from speculators.heads.dflash import DFlashDrafter
from speculators.heads.eagle import EagleHead
from speculators.heads.medusa import MedusaHeads

HEAD_SEED = 2
DRAFT_VOCAB = 9
SCALE = 0.3
"""Weights' spread: wide enough that the heads' distributions are far from uniform."""
MEDUSA_CHOICES = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0]]


def _randomised(module: torch.nn.Module, vocab: int) -> torch.Tensor:
    """Draw `module`'s weights; return the draft vocabulary (target ids) to give it."""
    torch.manual_seed(HEAD_SEED)
    for parameter in module.parameters():
        parameter.data.normal_(0, SCALE)
    return torch.randperm(vocab)[:DRAFT_VOCAB]


def write_eagle3(target: LlamaConfig, path: Path) -> Path:
    """An EAGLE-3 head reading the embedding output, the middle and the final output of a 2-layer target."""
    layer = LlamaConfig(**{**target.to_dict(), "num_hidden_layers": 1})
    head = EagleHead(layer, 3, target.hidden_size, DRAFT_VOCAB, (0, 1, target.num_hidden_layers), own_embedding=True)
    head.set_vocabulary(_randomised(head, target.vocab_size))
    save_eagle3(head, path, str(path), ["LlamaForCausalLM"], dtype=torch.float64)
    return path


def write_medusa(target: LlamaConfig, path: Path) -> Path:
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 3, 1, DRAFT_VOCAB, shared_lm_head=False)
    heads.token_map.copy_(_randomised(heads, target.vocab_size))
    save_medusa(heads, path, str(path), MEDUSA_CHOICES, dtype=torch.float64)
    return path


def write_dflash(target: LlamaConfig, path: Path) -> Path:
    """A one-layer drafter of blocks of 4 reading both layers' outputs of a 2-layer target, drafting
    the Medusa heads' tree; the last token is its mask token."""
    layer = Qwen3Config(vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                        num_hidden_layers=1, num_attention_heads=target.num_attention_heads,
                        num_key_value_heads=target.num_key_value_heads, rms_norm_eps=target.rms_norm_eps)
    drafter = DFlashDrafter(layer, (0, target.num_hidden_layers - 1), 4, target.vocab_size - 1,
                            tree_choices=MEDUSA_CHOICES, draft_vocab_size=DRAFT_VOCAB)
    drafter.set_vocabulary(_randomised(drafter, target.vocab_size))
    save_dflash(drafter, path, str(path), target.num_hidden_layers, dtype=torch.float64)
    return path
