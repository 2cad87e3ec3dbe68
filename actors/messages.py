"""The engine <-> target worker contract: what `start` and `verify` are given and give back.

The engine (cluster/engine) and the target workers (TargetWorker, a TargetGroup's shards) both take
these shapes from here, so neither reads the other's tuples by position; on Ray they travel pickled.
The precedent is vLLM's SpecDecodeMetadata: one named record where a call's parts were positional.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculators.sampling import SamplingParams
from speculators.shaping import Shaping
from speculators.tree import DraftTree
from speculators.verify import VerifyResult


@dataclass
class AdmitItem:
    """A request offered to `start`: its tokens so far (a prompt, or a resumed request's prompt and
    output) and the cache scope whose cached prefixes it may reuse (None: only its own)."""

    request_id: str
    tokens: list[int]
    sampling: SamplingParams
    cache_scope: str | None = None


class AdmissionRefused(ValueError):
    """`start` refuses a batch it can never serve (an empty prompt, one past the context window,
    one larger than the whole KV cache): the engine fails that batch's requests alone. Not "no room
    now" (that is `Admission.refused`, queued again); any other error of `start` is a target fault."""


@dataclass
class Admission:
    """What `start` did: which requests it admitted (with the prompt tokens it found cached), which
    it had no room for (the caller queues them again), and the prefilled tokens' hidden states when
    `hidden_layers` asks for them."""

    cached_tokens: dict[str, int]
    refused: list[str]
    hidden: dict[str, torch.Tensor] | None = None
    """Per admitted request, the prefilled tokens' rows: [prefilled tokens, len(hidden_layers) x hidden]."""
    free_blocks: int = 0
    """Blocks free or cached and unheld after the admission, of `total_blocks`."""
    total_blocks: int = 0


@dataclass
class VerifyItem:
    """One request of a verify call: its draft tree, and the step's Shaping (penalties, grammar
    mask, logprobs) when it has rules."""

    request_id: str
    tree: DraftTree
    shaping: Shaping | None = None
    keep_rows: bool = False
    """A request whose prompt ends in this pass and that drafts next step: a co-located head keeps
    its hidden rows for that call, though it drafted nothing this step."""
    predictions: bool = False
    """Return the target's choice after every node (VerifyResult.predictions): the drafter reads them."""


@dataclass
class PrefillChunk:
    """One chunk of a prompt prefilled in a verify call's pass, with the chunk's hidden states when
    `hidden_layers` asks for them."""

    seq_id: str
    start: int
    """The chunk's first position."""
    tokens: int
    """Prompt tokens it ran (past `start`)."""
    cached: int = 0
    """Prompt tokens found in the prefix cache just before it (filled meanwhile by another prompt
    with the same prefix) and not run: the prompt advanced by `cached + tokens`."""
    hidden: torch.Tensor | None = None
    """The chunk's rows: [tokens, len(hidden_layers) x hidden]."""


@dataclass
class Preempted:
    """In place of a VerifyResult: the KV cache had no room for the request's tree. Its blocks are
    freed; the engine resumes it later from its tokens so far (mostly found in the prefix cache)."""

    seq_id: str


@dataclass
class Waiting:
    """In place of a VerifyResult: the request's prompt is not all in yet (its last chunk waited for
    a block another prompt of the pass fills, to take it from the cache next pass). Its first root
    is verified in the pass that finishes the prompt."""

    seq_id: str


@dataclass
class RequestFailed:
    """In place of a VerifyResult: this request's verification raised. It ends with this error; the
    other requests of the batch keep their results."""

    reason: str


@dataclass
class VerifyReply:
    """What `verify` gives back: one result per VerifyItem, in item order, a PrefillChunk per prompt
    chunk run, and the requests outside the call that gave their blocks up so its trees fit."""

    results: list[VerifyResult | RequestFailed | Preempted | Waiting]
    prefill: list[PrefillChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    """Ids preempted that were not items of the call (prompts still being prefilled, requests of the
    other micro-batch), newest first: freed like a Preempted result; the engine sets them back too."""
