"""Builds an in-process engine (target worker, drafter, tokenizer) from an EngineConfig."""
from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from actors.model.llama import LlamaDecoder, layer_skip_draft
from actors.model.loader import load_model, load_tokenizer
from actors.model.runner import ModelRunner
from actors.target_worker import TargetWorker
from cluster.config import EngineConfig
from cluster.engine import SpecEngine
from speculators.proposers.base import Proposer
from speculators.proposers.draft_model import DraftModelProposer
from speculators.proposers.prompt_lookup import PromptLookupProposer


def build_proposer(config: EngineConfig, target: LlamaDecoder | None = None) -> Proposer | None:
    if config.method == "none":
        return None
    if config.method == "pld":
        return PromptLookupProposer(config.pld_num_pred_tokens, config.pld_max_ngram_size, config.pld_max_branches)
    layers = config.layer_skip_layers()
    if layers is not None:
        if target is None:
            raise ValueError("a layer-skip draft shares the target's weights; load the target first")
        draft = layer_skip_draft(target, layers)
    else:
        draft = load_model(config.draft, getattr(torch, config.dtype), config.device, attention_backend=config.attention_backend)
        if target is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft {config.draft!r} has {draft.config.vocab_size} tokens, the target "
                f"{target.config.vocab_size}: a draft model must share the target's tokenizer"
            )
    return DraftModelProposer(ModelRunner(draft, config.max_sequences, config.max_len), width=config.draft_width)


def build_engine(config: EngineConfig) -> tuple[SpecEngine, PreTrainedTokenizerBase]:
    tokenizer = load_tokenizer(config.model)
    target = load_model(config.model, getattr(torch, config.dtype), config.device, attention_backend=config.attention_backend)
    worker = TargetWorker(target, config.max_sequences, config.max_len)
    engine = SpecEngine(worker, tokenizer, build_proposer(config, target), config.max_tree_nodes)
    return engine, tokenizer
