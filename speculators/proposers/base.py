"""What every proposer implements, and the model interface a model-based drafter drives.

A proposer keeps its own per-request state (a draft KV cache, an n-gram index) and rolls it back
to the accepted prefix in `on_accept`. Model-based drafters talk to their network through
`TreeModel`, which the runtime in actors/ implements, so this package never imports a runtime.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from speculators.hidden import TargetHidden
from speculators.penalties import Penalties
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree


@dataclass
class VerifiedTree:
    """A request's last verified tree and the target's choice after each of its nodes (its argmax),
    for drafters that learn from every node of a pass, not only the accepted path (Lookahead
    decoding's window)."""

    token_ids: list[int]
    parents: list[int]
    predictions: list[int]


@dataclass
class DraftRequest:
    request_id: str
    token_ids: Sequence[int]
    """Everything committed so far (prompt and output); the last token is the tree root."""
    num_speculative_tokens: int
    """How deep this step may draft (the lookahead policy's answer)."""
    max_nodes: int
    """How many drafted nodes this request may use (its share of the step's budget)."""
    confidence_threshold: float = 0.0
    """Confidence rule: a token the drafter gives less than this ends its branch."""
    sampling: SamplingParams = SamplingParams()
    start: int = 0
    """Where `token_ids` begins in the request's sequence. A proposer always gets the whole
    sequence (start 0); between the engine and a draft worker only the tokens committed since the
    last call travel, and the worker keeps the rest."""
    hidden: TargetHidden | None = None
    """The target's hidden states of tokens committed since the last call, for proposers that read
    them (`Proposer.hidden_layers`); handed over once."""
    penalties: Penalties | None = None
    """The request's penalties: a drafter with a distribution applies them to it as the target
    does at the same node, so its drafts are likely under the penalised target."""
    prompt_length: int = 0
    """Where the output begins in the request's sequence (penalties count output tokens)."""
    verified: VerifiedTree | None = None
    """The request's tree verified since the last call, for proposers that read it
    (`Proposer.reads_verified`); None when there was none or it was lost (a failed call)."""
    cache_scope: str | None = ""
    """Whose earlier outputs this request may draft from: those learned under the same scope (a
    tenant's, or "" for everyone's); None: none, only the request's own text."""


class Proposer(ABC):
    name: str = "proposer"
    #: whether trees carry the drafter's probabilities (sampled requests use them losslessly)
    provides_probabilities: bool = False
    #: whether each drafted depth costs a forward pass of a network (the scheduler then decides how
    #: deep to draft before asking); False for lookups that cost microseconds
    runs_a_model: bool = False
    #: the target's hidden states this drafter reads, numbered as Hugging Face's `hidden_states`
    #: (i < num_layers: entering layer i; num_layers: the normed final output); empty: none
    hidden_layers: tuple[int, ...] = ()
    #: the dtype it wants them in
    hidden_dtype: torch.dtype = torch.float32
    #: whether it reads `DraftRequest.verified` (the target then returns its choice at every node)
    reads_verified: bool = False

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """One tree per request; a tree with only the root means 'no draft this step'."""

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The target committed `token_ids` (the full sequence now); roll state back to match."""

    def release(self, request_id: str) -> None:
        """The request finished or was cancelled: free its state."""

    def learn(self, output_ids: Sequence[int], scope: str | None = "") -> None:
        """A finished request's output (from any target group), for proposers that learn across
        requests; only requests of the same cache `scope` may draft from it (None: none may)."""

    def learn_steps(self, output_ids: Sequence[int], scope: str | None = "") -> Iterator[None]:
        """`learn` in short steps, yielding between them: a caller may run this proposer's other
        calls between two steps (never during one). By default, one step."""
        self.learn(output_ids, scope)
        yield


@dataclass
class TreeInput:
    """New tokens for one sequence of a TreeModel.

    `parents[i]` indexes the sequence's scratch tokens (those added since the last commit,
    earlier calls included, then these); -1 attaches a token straight to the committed context.
    """

    seq_id: str
    token_ids: Sequence[int]
    parents: Sequence[int]
    logits: Literal["all", "last", "none", "argmax"] = "all"
    """Which new tokens' next-token logits to return; "argmax": only the likeliest token id of each
    (greedy verification), found without gathering a tensor-parallel model's full rows."""


class TreeModel(Protocol):
    """A language model with a per-sequence KV cache that accepts trees of new tokens."""

    vocab_size: int

    def add(self, seq_id: str, cache_scope: str | None = None) -> None:
        """A new, empty sequence; its prefix may be shared with earlier ones of `cache_scope`."""

    def reuse_prefix(self, seq_id: str, tokens: Sequence[int]) -> int:
        """Take over the cached K/V of the longest shared prefix of `tokens`; how many tokens it holds."""

    def blocks_to_grow(self, seq_id: str, new_tokens: int) -> int:
        """KV cache blocks that writing `new_tokens` more tokens to the sequence would take."""

    @property
    def available_blocks(self) -> int:
        """KV cache blocks free or held only by the prefix cache."""

    def remove(self, seq_id: str) -> None: ...

    def has(self, seq_id: str) -> bool: ...

    def committed_length(self, seq_id: str) -> int: ...

    def scratch_size(self, seq_id: str) -> int: ...

    def forward(self, inputs: Sequence[TreeInput]) -> list[torch.Tensor | None]:
        """Per input, as its `logits` asks: "all" the next-token logits [n, V] of its n new tokens,
        "last" [1, V], "argmax" the likeliest token ids [n], "none" None (None too without tokens)."""

    def commit(self, seq_id: str, scratch_nodes: Sequence[int]) -> None:
        """Keep these scratch nodes (a root-to-node path, ascending) as committed; drop the rest."""

    def truncate(self, seq_id: str, length: int) -> None:
        """Forget everything past `length` committed tokens (scratch included)."""
