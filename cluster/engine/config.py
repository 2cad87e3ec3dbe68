"""Engine configuration: which target, which drafter, how much speculation, how much memory.

Fields use the names vLLM and transformers users know where one exists
(`prompt_lookup_num_tokens`); the names of earlier releases stay accepted as aliases, so old serve
configs keep working.
"""
from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from actors.model.config import DecoderConfig
from actors.model.kv_cache import KVCache
from actors.model.loader import DEFAULT_MODEL
from actors.model.precision import resolve_dtype
from actors.target_worker import CacheOptions
from speculators.datastore import read_manifest
from speculators.lookahead import LookaheadConfig
from speculators.proposers import lookahead_decoding as lade
from speculators.proposers import prompt_lookup as pld
from speculators.proposers import rest, suffix

Method = Literal["none", "pld", "suffix", "rest", "lookahead", "draft", "eagle3", "medusa", "parallel"]
HEAD_METHODS = ("eagle3", "medusa", "parallel")
"""Methods that draft with a trained head reading the target's hidden states."""
LAYER_SKIP_PREFIX = "layer-skip:"
MIN_AUTO_CHUNK = 64
"""The fewest prompt tokens an \"auto\" chunk carries: below this a pass's fixed cost dominates its prompt tokens."""
DEFAULT_KV_SEQUENCES = 8
"""kv_cache_bytes by default: max_len positions for 8 sequences, the memory of the slot cache of
earlier releases (which decoded 8 requests at once)."""
DEFAULT_DRAFT_WIDTH = {"eagle3": 4}
"""Widths measured best on Spec-Bench; a method not named drafts one branch. eagle3: EAGLE-2's tree of
width 4 beat the chain alone, under the planner (once it learned each depth's reach rather than
counting siblings as failed tries) and behind suffix decoding (figures: docs/benchmarks.md,
"Measurements behind the code")."""


class SchedulerConfig(BaseModel):
    """How the engine batches and how much it speculates."""

    model_config = ConfigDict(extra="forbid")

    max_sequences: int = Field(
        64, ge=1, le=1024, description="most requests decoded at once; how many fit is decided by free KV cache "
        "blocks (kv_cache_bytes), and a request that would not fit waits in the queue")
    max_len: int = Field(2048, ge=16, description="tokens per sequence, prompt and output (the context window)")
    kv_cache_bytes: int | None = Field(
        None, ge=1, description="memory of the target's KV cache, all tensor-parallel ranks together, in bytes; "
        "null: 8 x max_len positions of the target (e.g. 755 MB for SmolLM2-135M at max_len 2048)")
    block_size: int = Field(16, ge=1, le=256, description="positions per KV cache block (a power of two)")
    prefill_chunk_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto", description="chunked prefill: while as many requests decode as prompts wait, the most prompt tokens "
        "prefilled in one pass (while prompts outnumber them, as many as max_num_batched_tokens holds), packed "
        "into the same pass as their verification trees (the planner counts them); \"auto\": as many as "
        "cost `prefill_pass_ratio` times the pass's decoding by the target's measured cost curve (at least "
        f"{MIN_AUTO_CHUNK}; {MIN_AUTO_CHUNK} where the engine has no curve), so prompts are prefilled as fast as "
        "the load they arrive with while running streams' gaps stay bounded; null: a whole prompt in the pass that "
        "admits it (as many prompts a pass as max_num_batched_tokens holds)")
    prefill_pass_ratio: float = Field(
        4.0, gt=0, description="with prefill_chunk_tokens \"auto\": a pass carrying prompt tokens costs at most "
        "(1 + this) times its decoding alone, which gives prompts this share of the target while they wait")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="most prompt tokens plus decoding requests in one pass, so no burst of long prompts "
        "makes one pass of unbounded size: chunked, also when nothing decodes (every waiting prompt then shares it); "
        "with prefill_chunk_tokens null, the prompts admitted together (the rest wait for the next pass), save a "
        "prompt longer than this, which is prefilled alone")
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV cache blocks of a prompt prefix computed before in the same cache scope "
        "(the tenant, as limits.cache_sharing decides); off with trained heads (eagle3, medusa, parallel), which need every "
        "prompt token's hidden state")
    max_tree_nodes: int = Field(32, ge=0, le=256, description="most drafted tokens in one request's tree")
    lookahead: LookaheadConfig = Field(
        default_factory=LookaheadConfig, description="lookahead of a request that does not choose its own")
    step_token_budget: int | None = Field(
        None, ge=0, description="a fixed number of drafted tokens per step for the whole micro-batch, shared "
        "equally; null (the default) lets the planner size every request's draft from the target's measured "
        "cost curve and the acceptance it has seen (goodput-based, down to no speculation)")
    sampling_rule: Literal["keyed", "rejection"] = Field(
        "keyed", description="how a sampled request without a seed is verified (a seeded one is always keyed): "
        "keyed, with noise keyed by a random seed and position, so the planner may cut its trees to what pays; or "
        "rejection, recursive rejection sampling against the drafter's probabilities, which keeps a little more of "
        "a sampled draft but verifies every tree whole (both lossless; measured in docs/benchmarks.md, "
        "\"Seeded sampling\")")
    pipeline: bool = Field(
        False, description="split requests into two micro-batches so one is drafted while the other is verified")
    min_acceptance: float = Field(
        0.1, ge=0, le=1,
        description="a request whose averaged accepted/drafted depth falls below this stops speculating for a while")
    gate_warmup_steps: int = Field(4, ge=1, description="drafted steps before the acceptance gate may close")
    gate_cooloff_steps: int = Field(16, ge=1, description="plain steps before a closed gate speculates again")
    draft_timeout_s: float = Field(
        10.0, gt=0, description="longest wait for a drafter's proposals; past it the step decodes plainly and the "
        "drafter gets no more work until it answers")
    target_timeout_s: float = Field(
        300.0, gt=0, description="longest wait for a prefill or verification pass; past it the target group "
        "counts as failed (its requests end with a retryable error) and is rebuilt")
    rebuild_retry_s: float = Field(
        30.0, gt=0, description="after a failed rebuild of the target, how long new requests are refused "
        "(with a retryable error) before the next try")


    @model_validator(mode="after")
    def _every_decoding_request_fits_a_pass(self) -> SchedulerConfig:
        """A pass counts one token a decoding request at least (vLLM refuses the same)."""
        if self.max_num_batched_tokens < self.max_sequences:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_sequences "
                             f"({self.max_sequences}): every decoding request takes a token of each pass")
        return self

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two, not {value}")
        return value

    def kv_budget(self, model: DecoderConfig, dtype: torch.dtype) -> int:
        """`kv_cache_bytes`, or its default for this target."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        return DEFAULT_KV_SEQUENCES * self.max_len * _bytes_per_position(model, dtype)

    def cache_options(self, model: DecoderConfig, dtype: torch.dtype) -> CacheOptions:
        """The target's KV cache layout: `kv_cache_bytes` in blocks (at least one max_len sequence).
        A draft model's cache gets as many blocks: it holds the same sequences."""
        position, budget = _bytes_per_position(model, dtype), self.kv_budget(model, dtype)
        blocks = budget // (position * self.block_size)
        if blocks * self.block_size < self.max_len:
            raise ValueError(f"kv_cache_bytes ({budget}) holds {blocks * self.block_size} positions, fewer than one "
                             f"sequence of max_len ({self.max_len}); at least {position * self.max_len} bytes are needed")
        return CacheOptions(blocks, self.block_size, self.enable_prefix_caching)


def _bytes_per_position(model: DecoderConfig, dtype: torch.dtype) -> int:
    return KVCache.bytes_per_position(model.num_layers, model.num_kv_heads, model.head_dim, dtype)


class EngineConfig(SchedulerConfig):
    """A whole in-process engine: target, drafter and scheduler."""

    model: str = Field(DEFAULT_MODEL, description="target: a known name, a .gguf file or a Hugging Face directory")
    method: Method = Field(
        "suffix", description="drafter: none (plain decoding), pld (prompt lookup), suffix (suffix decoding over "
        "the request's own text and earlier outputs), rest (retrieval from the corpus of rest_datastore), lookahead "
        "(Lookahead decoding: n-grams from Jacobi iterations in the verification pass), draft (a "
        "draft model), or a trained head reading the "
        "target's hidden states: eagle3 (an EAGLE-3 head, or an EAGLE-1/2 checkpoint), medusa, or parallel (a DFlash "
        "block drafter: every depth from one pass)")
    draft: str = Field(
        "layer-skip:6",
        description="method=draft: a model name/path with the target's tokenizer, or 'layer-skip:N' for a "
        "self-draft made of the target's first N layers; eagle3/medusa/parallel: a head checkpoint folder or a "
        "trained head's name such as 'eagle3:smollm2-135m' (the layer-skip default means the method's trained "
        "head for the target)",
    )
    draft_width: int | None = Field(
        None, ge=1, le=16, description="draft model and sampled requests: branches at the root of each tree; "
        "eagle3 greedy requests: 1 drafts a chain, k > 1 EAGLE-2's dynamic tree expanding the k best nodes "
        "by k tokens at each depth; null: the method's best measured width (eagle3 4, else 1)")
    medusa_choices: list[list[int]] | None = Field(
        None, description="medusa and parallel: the static tree as a list of rank paths ([[0], [0, 0], [1], ...]); "
        "null takes the head checkpoint's own (a parallel drafter's without one: a chain)")
    suffix_min_score: float | None = Field(
        None, ge=0, description="eagle3/medusa/parallel: suffix decoding drafts first, and its tree is used when its "
        "expected accepted tokens reach this score, else the head's (Arctic Inference's hybrid); null: the head "
        "alone")
    prompt_lookup_num_tokens: int = Field(
        pld.NUM_TOKENS, ge=1, le=64, validation_alias=AliasChoices("prompt_lookup_num_tokens", "pld_num_pred_tokens"),
        description="prompt lookup: most tokens copied after a match (alias pld_num_pred_tokens)")
    prompt_lookup_max_ngram_size: int = Field(
        pld.MAX_NGRAM_SIZE, ge=1, le=16, validation_alias=AliasChoices("prompt_lookup_max_ngram_size", "pld_max_ngram_size"),
        description="prompt lookup: longest n-gram matched (alias pld_max_ngram_size)")
    prompt_lookup_max_branches: int = Field(
        pld.MAX_BRANCHES, ge=1, le=16, validation_alias=AliasChoices("prompt_lookup_max_branches", "pld_max_branches"),
        description="prompt lookup: earlier matches merged into one tree (alias pld_max_branches)")
    suffix_decoding_max_tree_depth: int = Field(
        suffix.MAX_DEPTH, ge=2, le=128, description="suffix decoding: longest substring of earlier outputs indexed")
    suffix_decoding_max_spec_factor: float = Field(
        suffix.MAX_SPEC_FACTOR, gt=0, description="suffix decoding: at most this many drafted tokens per matched token")
    suffix_decoding_min_token_prob: float = Field(
        suffix.MIN_TOKEN_PROB, ge=0, le=1,
        description="suffix decoding: draft nodes whose estimated path probability is at least this")
    suffix_decoding_max_cached_tokens: int = Field(
        suffix.MAX_CACHED_TOKENS, ge=1, description="suffix decoding: tokens of earlier outputs kept per draft actor, all "
        "cache scopes together (oldest evicted)")
    suffix_decoding_max_cached_bytes: int | None = Field(
        suffix.MAX_CACHED_BYTES, ge=1 << 16, description="suffix decoding: memory of the index of earlier outputs per draft "
        "actor, all cache scopes together, in bytes as estimated from its parts (oldest outputs evicted; ~440 bytes per "
        "learned token on Spec-Bench text, so the token bound binds first at the defaults); null: the token bound alone")
    rest_datastore: str | None = Field(
        None, validate_default=True, description="method=rest: the datastore folder `specserve build-datastore` "
        "wrote from the operator's corpus with the target's tokenizer (read-only and memory-mapped, shared by every "
        "tenant and drafter)")
    rest_max_match: int = Field(
        rest.MAX_MATCH, ge=rest.MIN_MATCH, le=64, description="REST: longest suffix of the context looked up in the "
        f"datastore (the longest that occurs, down to {rest.MIN_MATCH} tokens, is used)")
    rest_max_occurrences: int = Field(
        rest.MAX_OCCURRENCES, ge=1, le=65536, description="REST: most occurrences of the matched suffix whose "
        "continuations are counted into the draft tree (evenly spaced over all of them)")
    lookahead_decoding_window_size: int = Field(
        lade.WINDOW, ge=1, le=32, description="Lookahead decoding: Jacobi window columns (W), each guessing one more "
        "token ahead")
    lookahead_decoding_ngram_size: int = Field(
        lade.NGRAM, ge=2, le=16, description="Lookahead decoding: n-gram size (N); a column keeps N - 1 tokens of its trajectory")
    lookahead_decoding_verification_set_size: int = Field(
        lade.CANDIDATES, ge=0, le=64, description="Lookahead decoding: most pool n-grams starting with the last token "
        "verified a step (G)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="weights and KV cache dtype; auto: bfloat16 on a GPU, and on a CPU with native "
        "bfloat16 (AVX512-BF16 or AMX) where its products are exact per row (actors/model/precision.py), else "
        "float32. On a CPU speculative greedy output is plain decoding's bit for bit in bfloat16, and in float32 has "
        "been in every run but is not guaranteed; on a GPU either can part at a near-tie (docs/lossless.md)")
    device: str = Field("cpu", description="torch device of the model")
    cpu_threads: int | None = Field(
        None, ge=1, description="torch threads in each target shard and draft actor; null: the cores the process "
        "may use, shared among a target group's ranks (Ray would otherwise run an actor that reserves no CPU on "
        "one thread), fewer while another process holds cores during the passes (actors/model/threads.py)")
    cuda_graphs: bool = Field(
        False, description="on a GPU, replay captured CUDA graphs for one-sequence passes of up to 64 new tokens "
        "(decode, small verification and draft steps); ignored on a CPU")
    attention_backend: Literal["sdpa", "split"] = Field(
        "sdpa", description="attention kernel: sdpa (one masked attention over each sequence's cache) or split "
        "(the committed prefix without a mask, through vllm_flash_attn when it imports on CUDA, merged with the "
        "tree block's masked attention by log-sum-exp)")

    @field_validator("rest_datastore")
    @classmethod
    def _readable_datastore(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Required by method rest, and read where the config is checked, so that a wrong path fails
        at startup rather than in a drafter."""
        if value is None and info.data.get("method") == "rest":
            raise ValueError("method rest needs a datastore: a folder written by `specserve build-datastore`")
        if value is not None:
            read_manifest(value)
        return value

    @model_validator(mode="after")
    def _resolve_auto_dtype(self) -> EngineConfig:
        """auto becomes a dtype where the config is built: the actors, the cost-curve key and the
        KV budget all read one answer."""
        self.dtype = resolve_dtype(self.dtype, self.device)
        return self

    def drafting_width(self) -> int:
        """`draft_width`, or the method's default when it is not set."""
        return self.draft_width or DEFAULT_DRAFT_WIDTH.get(self.method, 1)

    def layer_skip_layers(self) -> int | None:
        """N of a 'layer-skip:N' draft, else None."""
        if self.draft.startswith(LAYER_SKIP_PREFIX):
            return int(self.draft[len(LAYER_SKIP_PREFIX):])
        return None
