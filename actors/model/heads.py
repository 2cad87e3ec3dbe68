"""Trained heads at run time: finding them, loading them next to (or inside) their target.

`--draft eagle3:smollm2-135m` names a head trained by this project and committed under
speculators/heads/trained/<method>-<model>/; any other value is a checkpoint folder in a layout
speculators/heads/checkpoint.py reads, with safetensors weights (a head published as PyTorch
pickles is refused, naming `specserve convert-head`, which rewrites it once). A head that lacks its
own embedding (and an EAGLE-1/2 head, which scores with the target's LM head) uses the target's
tensors: shared, not copied, when the head lives in the target's process (co-located), and read
from the target's checkpoint (those tensors only) when it lives in a draft actor on its own devices.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from actors.model.config import DecoderConfig
from actors.model.llama import LlamaDecoder
from actors.model.loader import load_tensors
from actors.model.projection import Projection
from speculators.heads.checkpoint import load_head
from speculators.proposers.base import Proposer
from speculators.proposers.eagle import EagleProposer
from speculators.proposers.medusa import MedusaProposer
from speculators.proposers.parallel import ParallelProposer

TRAINED_HEADS = Path(__file__).resolve().parents[2] / "speculators" / "heads" / "trained"
HEAD_KINDS = {"eagle3": ("eagle3", "eagle"), "medusa": ("medusa",), "parallel": ("dflash",)}
"""method -> checkpoint kinds it serves (EAGLE-1/2 checkpoints draft the way EAGLE-3 heads do)."""


def trained_heads() -> list[str]:
    """Names of the heads committed with the project, as `--draft` takes them."""
    if not TRAINED_HEADS.is_dir():
        return []
    return sorted(p.name.replace("-", ":", 1) for p in TRAINED_HEADS.iterdir() if (p / "config.json").exists())


def resolve_head(method: str, draft: str, model: str) -> Path:
    """The checkpoint folder of `draft`; a draft that names no head (the layer-skip default) means
    this project's trained head of `method` for the target `model`."""
    if draft.startswith("layer-skip:"):
        draft = f"{method}:{Path(model).name}"
    name, _, target = draft.partition(":")
    if target and name in HEAD_KINDS:
        folder = TRAINED_HEADS / f"{name}-{target}"
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"no trained head {draft!r}; this project has {', '.join(trained_heads()) or 'none'}, "
                                    "or give a checkpoint folder (specserve train makes one)")
        return folder
    folder = Path(draft).expanduser()
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"head {draft!r} is neither a trained head name nor a folder with config.json")
    return folder


def fast_projections(module: nn.Module) -> nn.Module:
    """Every nn.Linear of a head computed as the decoder's Projection (same parameters), the faster
    product at the few rows a drafter runs on a CPU."""
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = Projection
    return module


def head_proposer(method: str, source: Path, config: DecoderConfig, model: str, width: int = 1,
                  medusa_choices: list[list[int]] | None = None, target: LlamaDecoder | None = None,
                  dtype: torch.dtype = torch.float32, device: str = "cpu") -> Proposer:
    """The proposer of a head checkpoint for the target `model` (`config`); `target`, when given,
    is the target itself in this process, whose tensors the head then shares."""
    checkpoint = load_head(source, config.num_layers)
    if checkpoint.kind not in HEAD_KINDS[method]:
        raise ValueError(f"{source} holds a {checkpoint.kind} head, not one for method {method!r}")
    module = checkpoint.module.to(dtype).to(device).eval()
    vocab = getattr(module, "vocab_size", None) or module.config.vocab_size
    if vocab != config.vocab_size:
        raise ValueError(f"{source} was trained for a vocabulary of {vocab} tokens; the target has {config.vocab_size}")
    if checkpoint.kind == "medusa":
        return MedusaProposer(fast_projections(module), config.num_layers, medusa_choices or checkpoint.medusa_choices)
    _attach_target(module, model, target, dtype, device)
    if checkpoint.kind == "dflash":
        return ParallelProposer(fast_projections(module), medusa_choices)
    return EagleProposer(fast_projections(module), width)


def _attach_target(head, model: str, target: LlamaDecoder | None, dtype: torch.dtype, device: str) -> None:
    if head.embed_tokens is not None and not head.needs_target_lm_head:
        return
    if target is not None and target.comm.world_size == 1:
        head.share_target(target.model.embed_tokens.weight, target.head_weight())
        return
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    tensors = load_tensors(model, names, dtype, device)
    embedding = tensors[names[0]]
    head.share_target(embedding, tensors.get(names[1], embedding) if head.needs_target_lm_head else None)
