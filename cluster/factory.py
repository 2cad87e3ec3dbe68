"""Builds drafters and an in-process engine from an EngineConfig."""
from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from actors.draft_worker import DraftWorker
from actors.model.llama import LlamaDecoder, layer_skip_draft
from actors.model.loader import load_model, load_tokenizer
from actors.model.runner import ModelRunner
from actors.target_worker import TargetWorker
from cluster.config import EngineConfig, SchedulerConfig
from cluster.engine import SpecEngine
from cluster.workers import LocalWorker
from speculators.proposers.base import Proposer
from speculators.proposers.draft_model import DraftModelProposer
from speculators.proposers.prompt_lookup import PromptLookupProposer


def build_proposer(config: EngineConfig, target: LlamaDecoder | None = None) -> Proposer | None:
    """The configured drafter. A layer-skip draft shares `target`'s weights when given one, and
    otherwise loads only the first N layers itself (a draft actor on its own devices)."""
    if config.method == "none":
        return None
    if config.method == "pld":
        return PromptLookupProposer(config.pld_num_pred_tokens, config.pld_max_ngram_size, config.pld_max_branches)
    dtype = getattr(torch, config.dtype)
    layers = config.layer_skip_layers()
    if layers is not None and target is not None:
        draft = layer_skip_draft(target, layers)
    elif layers is not None:
        draft = load_model(config.model, dtype, config.device, attention_backend=config.attention_backend, num_layers=layers)
    else:
        draft = load_model(config.draft, dtype, config.device, attention_backend=config.attention_backend)
    if target is not None and draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft {config.draft!r} has {draft.config.vocab_size} tokens, the target "
            f"{target.config.vocab_size}: a draft model must share the target's tokenizer"
        )
    return DraftModelProposer(ModelRunner(draft, config.max_sequences, config.max_len), width=config.draft_width)


def local_engine(
    target: LlamaDecoder,
    tokenizer,
    proposer: Proposer | None,
    config: SchedulerConfig = SchedulerConfig(),
    eos_token_ids=(),
) -> SpecEngine:
    """An engine whose target and drafter run in this process (each on its own thread)."""
    worker = LocalWorker(TargetWorker(target, config.max_sequences, config.max_len), "target")
    drafters = [] if proposer is None else [LocalWorker(DraftWorker(lambda: proposer), "draft")]
    eos = set(eos_token_ids) | set(target.config.eos_token_ids)
    return SpecEngine(worker, tokenizer, drafters, config, eos, vocab_size=target.config.vocab_size)


def build_engine(config: EngineConfig) -> tuple[SpecEngine, PreTrainedTokenizerBase]:
    tokenizer = load_tokenizer(config.model)
    target = load_model(config.model, getattr(torch, config.dtype), config.device, attention_backend=config.attention_backend)
    return local_engine(target, tokenizer, build_proposer(config, target), config), tokenizer
