"""Builds drafters and an in-process engine from an EngineConfig, and the command-line options that
make one (shared by `specserve generate` and the benchmarks, with the config's own defaults)."""
from __future__ import annotations

import argparse
import typing

import torch
from transformers import PreTrainedTokenizerBase

from actors.draft_worker import DraftWorker
from actors.model.heads import head_proposer, resolve_head
from actors.model.llama import LlamaDecoder, layer_skip_draft
from actors.model.loader import load_config, load_model, load_tokenizer, resolve_model
from actors.model.runner import ModelRunner
from actors.model.threads import available_cores
from actors.target_worker import TargetWorker
from actors.worker import LocalWorker
from cluster.engine.config import HEAD_METHODS, EngineConfig, SchedulerConfig
from cluster.engine.cost import CostCurve, cache_key
from cluster.engine.cost import measure as measure_cost
from cluster.engine.request import GenerationRequest
from cluster.engine.spec_engine import SpecEngine
from speculators.datastore import Datastore, tokenizer_fingerprint
from speculators.lookahead import LookaheadConfig
from speculators.proposers.base import Proposer
from speculators.proposers.draft_model import DraftModelProposer
from speculators.proposers.hybrid import HybridProposer
from speculators.proposers.lookahead_decoding import LookaheadProposer
from speculators.proposers.prompt_lookup import PromptLookupProposer
from speculators.proposers.rest import RestProposer
from speculators.proposers.suffix import SuffixProposer
from speculators.train.recorder import Decode, Decoder


def build_proposer(config: EngineConfig, target: LlamaDecoder | None = None) -> Proposer | None:
    """The configured drafter. A layer-skip draft shares `target`'s weights when given one, and
    otherwise loads only the first N layers itself (a draft actor on its own devices); a trained
    head likewise shares the target's embedding (and LM head) or reads them from its checkpoint."""
    if config.method == "none":
        return None
    if config.method == "pld":
        return PromptLookupProposer(config.prompt_lookup_num_tokens, config.prompt_lookup_max_ngram_size,
                                    config.prompt_lookup_max_branches)
    if config.method == "suffix":
        return suffix_proposer(config)
    if config.method == "rest":
        return rest_proposer(config)
    if config.method == "lookahead":
        return LookaheadProposer(config.lookahead_decoding_window_size, config.lookahead_decoding_ngram_size,
                                 config.lookahead_decoding_verification_set_size)
    dtype = getattr(torch, config.dtype)
    if config.method in HEAD_METHODS:
        source = resolve_head(config.method, config.draft, config.model)
        head = head_proposer(config.method, source, load_config(resolve_model(config.model)), config.model,
                             config.drafting_width(), config.medusa_choices, target, dtype, config.device)
        return head if config.suffix_min_score is None else HybridProposer(suffix_proposer(config), head,
                                                                             config.suffix_min_score)
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
    target_config = target.config if target is not None else load_config(resolve_model(config.model))
    blocks = config.cache_options(target_config, dtype).blocks
    runner = ModelRunner(draft, config.max_sequences, config.max_len, config.cuda_graphs, kv_blocks=blocks,
                         block_size=config.block_size, prefix_caching=config.enable_prefix_caching)
    return DraftModelProposer(runner, width=config.drafting_width())


def suffix_proposer(config: EngineConfig) -> SuffixProposer:
    return SuffixProposer(config.suffix_decoding_max_tree_depth, max_spec_factor=config.suffix_decoding_max_spec_factor,
                          min_token_prob=config.suffix_decoding_min_token_prob,
                          max_cached_tokens=config.suffix_decoding_max_cached_tokens,
                          max_cached_bytes=config.suffix_decoding_max_cached_bytes)


def rest_proposer(config: EngineConfig) -> RestProposer:
    """REST over `rest_datastore`, refused when the datastore's token ids are another tokenizer's:
    its drafts would still be verified losslessly, but never accepted."""
    datastore = Datastore.open(config.rest_datastore)
    if datastore.manifest["tokenizer"] != tokenizer_fingerprint(load_tokenizer(config.model)):
        raise ValueError(f"rest_datastore {config.rest_datastore!r} was built with the tokenizer of "
                         f"{datastore.manifest.get('model')!r}, not with the target's ({config.model!r})")
    return RestProposer(datastore, config.rest_max_match, max_occurrences=config.rest_max_occurrences)


def local_engine(
    target: LlamaDecoder,
    tokenizer,
    proposer: Proposer | None,
    config: SchedulerConfig = SchedulerConfig(),
    eos_token_ids=(),
    cost: CostCurve | bool = False,
    cost_key: str | None = None,
    cuda_graphs: bool = False,
) -> SpecEngine:
    """An engine whose target and drafter run in this process, in the caller's thread (see LocalWorker).

    `cost` turns on the planner's draft sizing: a CostCurve to use, or True to measure the target's
    (read from the cache under `cost_key` when there).
    """
    hidden = {} if proposer is None else {"hidden_layers": proposer.hidden_layers, "hidden_dtype": proposer.hidden_dtype}
    worker = LocalWorker(TargetWorker(target, config.max_sequences, config.max_len, cuda_graphs, **hidden,
                                      cache=config.cache_options(target.config, target.dtype)), "target")
    drafters = [] if proposer is None else [LocalWorker(DraftWorker(lambda: proposer), "draft")]
    eos = set(eos_token_ids) | set(target.config.eos_token_ids)
    curve = None
    if proposer is not None and cost is not False:
        curve = cost if isinstance(cost, CostCurve) else measure_cost(worker, config.max_sequences, config.max_len, cost_key)
    return SpecEngine(worker, tokenizer, drafters, config, eos, vocab_size=target.config.vocab_size, cost=curve,
                      costly_drafter=proposer is not None and proposer.runs_a_model)


def recording_decoder(target, tokenizer, max_sequences: int, max_len: int) -> Decoder:
    """The engine, in this process, as an `AnswerRecorder` decodes (`specserve train`, bench/head_transfer.py):
    greedy, with the recorder as drafter, drafting at every step so every pass's rows reach it."""
    def decoder(drafter) -> Decode:
        config = SchedulerConfig(max_sequences=max_sequences, max_len=max_len, min_acceptance=0.0)
        engine = local_engine(target, tokenizer, drafter, config)

        def decode(prompts: list[tuple[str, list[int]]], max_new_tokens: int) -> list[list[int]]:
            requests = [GenerationRequest(request_id, ids, max_new_tokens=max_new_tokens) for request_id, ids in prompts]
            return [output.token_ids for output in engine.generate(requests)]
        return decode
    return decoder


def cost_key_of(config: EngineConfig, tensor_parallel_size: int = 1) -> str:
    """The cost-curve cache key of a target as this config runs it: the shapes measured follow
    `max_sequences`, and a pass's time the threads each rank computes on (actors/model/threads.py)."""
    threads = config.cpu_threads or max(1, available_cores() // tensor_parallel_size)
    return cache_key(resolve_model(config.model).resolve(), config.dtype, config.device, tensor_parallel_size,
                     config.max_sequences, threads)


def build_engine(config: EngineConfig) -> tuple[SpecEngine, PreTrainedTokenizerBase]:
    tokenizer = load_tokenizer(config.model)
    target = load_model(config.model, getattr(torch, config.dtype), config.device, attention_backend=config.attention_backend)
    engine = local_engine(target, tokenizer, build_proposer(config, target), config,
                          cost=config.step_token_budget is None, cost_key=cost_key_of(config), cuda_graphs=config.cuda_graphs)
    return engine, tokenizer


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Prompt token ids, through the model's chat template when `chat` (as Spec-Bench does)."""
    if chat:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False))
    return tokenizer.encode(prompt)


# ---- command-line options ----------------------------------------------------------------------

ENGINE_OPTIONS = {
    ("--model",): "model",
    ("--draft",): "draft",
    ("--draft-width",): "draft_width",
    ("--suffix-min-score",): "suffix_min_score",
    ("--pld-tokens", "--prompt-lookup-num-tokens"): "prompt_lookup_num_tokens",
    ("--pld-ngram", "--prompt-lookup-max-ngram-size"): "prompt_lookup_max_ngram_size",
    ("--pld-branches", "--prompt-lookup-max-branches"): "prompt_lookup_max_branches",
    ("--rest-datastore",): "rest_datastore",
    ("--rest-max-match",): "rest_max_match",
    ("--rest-max-occurrences",): "rest_max_occurrences",
    ("--max-tree-nodes",): "max_tree_nodes",
    ("--max-len",): "max_len",
    ("--kv-cache-bytes",): "kv_cache_bytes",
    ("--block-size",): "block_size",
    ("--dtype",): "dtype",
    ("--lookahead",): "lookahead.policy",
    ("--lookahead-tokens", "--num-speculative-tokens"): "lookahead.num_speculative_tokens",
    ("--threshold", "--confidence-threshold"): "lookahead.confidence_threshold",
}
"""Options -> EngineConfig fields (dotted for the lookahead's); type, default and help come from the field."""


def _field(path: str):
    section, _, name = path.rpartition(".")
    return (LookaheadConfig if section == "lookahead" else EngineConfig).model_fields[name]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    for flags, path in ENGINE_OPTIONS.items():
        field = _field(path)
        default = field.get_default(call_default_factory=True)
        kind = field.annotation
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        parser.add_argument(*flags, dest=path, default=default, type=_value_type(kind), choices=choices,
                            help=field.description)


def _value_type(annotation):
    """The type an option's text converts to: the field's, or for `X | None` the X."""
    if typing.get_origin(annotation) is typing.Literal:
        return type(typing.get_args(annotation)[0])
    kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
    return kinds[0] if kinds else annotation


def engine_config_from_args(args: argparse.Namespace, method: str | None = None, **overrides) -> EngineConfig:
    """The EngineConfig the options describe; `method` and `overrides` set further fields."""
    values: dict = {"max_sequences": 1, **({} if method is None else {"method": method})}
    lookahead: dict = {}
    for path in ENGINE_OPTIONS.values():
        section, _, name = path.rpartition(".")
        (lookahead if section == "lookahead" else values)[name] = getattr(args, path)
    return EngineConfig(**{**values, "lookahead": LookaheadConfig(**lookahead), **overrides})
