"""The cases of the losslessness proof: which drafter, tree shape, lookahead, sampling warp and
deployment each one samples the engine with.

A case is a few lines. A later sampling feature (penalties, structured-output masks, n > 1) adds
its case here with RequestGroups that use it, and teaches target.sequence_distribution the same rule,
so that the reference is what the feature defines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from speculators.lookahead import LookaheadConfig
from speculators.penalties import Penalties
from speculators.sampling import SamplingParams

PROMPT = (1, 2, 7, 11, 1, 2, 9, 0, 1, 2, 3, 0, 1, 2)
"""Ends in '1 2', which three different tokens followed before: prompt lookup drafts a chain, or a
tree with three children at the root when it may take three matches. Chosen so that the target
gives the chain's first token 0.29 (prompt lookup gets some drafts accepted) and no token more."""
SHORT_PROMPT = (9, 3, 9)
LONG_PROMPT = (4, 8, 10, 11, 2, 3, 4, 8, 10, 11, 2, 3, 11, 0, 4, 8, 10, 11, 2)
CORE_SAMPLES = 60_000
"""Enough to detect 0.84% of first-token mass moved between the two likeliest tokens (0.29 and 0.12)."""
SAMPLES = 20_000

T1 = SamplingParams(temperature=1.0)
GREEDY = SamplingParams()
FIXED = LookaheadConfig(policy="fixed", num_speculative_tokens=3)
HEURISTIC = LookaheadConfig(policy="heuristic", initial_tokens=2)
CONFIDENCE = LookaheadConfig(policy="confidence")
PENALTIES = Penalties(presence=1.5, frequency=1.0, repetition=2.0)
"""Strong enough that a token drafted above a node changes its distribution a lot (what a verifier
that forgets the drafted path gets wrong)."""


@dataclass(frozen=True)
class Alternation:
    """A grammar over the tiny vocabulary: output tokens alternate between two sets, `first` first.

    The engine gets it as a regular expression over the tokens' texts ('t<i>'), compiled by the
    grammar engine; the reference applies it as this rule, token by token, so the two are written
    independently.
    """

    first: tuple[int, ...]
    second: tuple[int, ...]

    def regex(self) -> str:
        first, second = (f"t({'|'.join(map(str, tokens))})" for tokens in (self.first, self.second))
        return f"({first}{second})*({first})?"

    def allowed(self, position: int) -> tuple[int, ...]:
        """Tokens allowed at output position `position` (0-based)."""
        return self.second if position % 2 else self.first


@dataclass(frozen=True)
class RequestGroup:
    """Requests sharing a prompt, a sampling rule and a length: together, a sample of one distribution."""

    sampling: SamplingParams = T1
    prompt: tuple[int, ...] = PROMPT
    new_tokens: int = 4
    share: float = 1.0
    """Fraction of the case's requests."""
    penalties: Penalties | None = None
    rule: Alternation | None = None
    """A grammar the output must follow (structured output)."""


@dataclass(frozen=True)
class Deployment:
    """Where the engine runs: in this process, or a SpecCluster on Ray with fake GPUs."""

    ray: bool = False
    tensor_parallel_size: int = 1
    draft_actors: int = 1


IN_PROCESS = Deployment()


@dataclass
class Case:
    name: str
    drafter: str
    """A key of DRAFTERS."""
    samples: int = SAMPLES
    lookahead: LookaheadConfig = field(default_factory=FIXED.model_copy)
    groups: tuple[RequestGroup, ...] = (RequestGroup(),)
    engine: dict[str, Any] = field(default_factory=dict)
    """Further EngineConfig fields (draft_width, pipeline), and `kv_positions`: a KV cache of that
    many positions instead of room for every request of the batch."""
    deployment: Deployment = IN_PROCESS
    core: bool = False
    """Sized so that a 1% shift in the first-token conditional is detected."""
    planned: bool = False
    """In process, with the planner on over PLANNER_COST (on Ray it is always on, over the
    measured curve): trees are cut to what pays, or not drafted at all."""
    rule: str = "rejection"
    """The sampling rule of its requests (SamplingParams.rule; every request carries a seed, so
    that a case draws the same samples on every run). 'keyed' cases also run the same requests
    with speculation off and must give identical sequences."""

    @property
    def keyed(self) -> bool:
        return self.rule == "keyed"


DRAFTERS = {
    "pld": {"method": "pld", "prompt_lookup_max_branches": 1},
    "pld-tree": {"method": "pld", "prompt_lookup_max_branches": 3},
    "draft": {"method": "draft", "draft": "<draft model>"},
    "layer-skip": {"method": "draft", "draft": "layer-skip:1"},
    "suffix": {"method": "suffix", "suffix_decoding_max_spec_factor": 2.0},
    "rest": {"method": "rest", "rest_datastore": "<rest datastore>"},
    "lookahead": {"method": "lookahead", "lookahead_decoding_ngram_size": 3},
    "eagle3": {"method": "eagle3", "draft": "<eagle3 head>"},
    "medusa": {"method": "medusa", "draft": "<medusa head>"},
    "parallel": {"method": "parallel", "draft": "<dflash drafter>"},
    "suffix-eagle3": {"method": "eagle3", "draft": "<eagle3 head>", "suffix_min_score": 1.0},
}
"""EngineConfig fields of each drafter; '<draft model>', '<eagle3 head>', '<medusa head>', '<dflash
drafter>' and '<rest datastore>' stand for the paths of the separate tiny draft, of the random heads and
of a datastore of the target's samples (engines.PLACEHOLDERS)."""

TREE = {"draft_width": 3}
TIGHT_KV = {"kv_positions": 32 * 32, "block_size": 4, "prefill_chunk_tokens": 6}
"""A KV cache for 32 of the batch's 512 requests, prompts prefilled 6 tokens a pass: requests wait
for blocks, find their prompt's blocks in the prefix cache, and are preempted and resumed."""


def _mixed_batch() -> tuple[RequestGroup, ...]:
    """Greedy and sampled requests of different prompt and output lengths, decoded side by side."""
    return (
        RequestGroup(T1, share=0.45),
        RequestGroup(SamplingParams(0.8, top_k=6), SHORT_PROMPT, new_tokens=3, share=0.45),
        RequestGroup(GREEDY, share=0.05),
        RequestGroup(GREEDY, LONG_PROMPT, new_tokens=3, share=0.05),
    )


ALTERNATION = Alternation(first=(0, 1, 2, 3, 10, 11), second=(1, 2, 4, 5, 6, 7, 8, 9))
"""Overlapping sets, one- and two-digit tokens ('t1' is a prefix of 't10' and 't11'): what a
tokenizer-aware grammar engine must get right. Prompt lookup's drafts break it often."""


CASES = [
    # every drafter, as a chain and as a tree with several children
    Case("pld-chain", "pld", CORE_SAMPLES, core=True),
    Case("pld-tree", "pld-tree", CORE_SAMPLES, core=True),
    Case("draft-chain", "draft", CORE_SAMPLES, core=True),
    Case("draft-tree", "draft", CORE_SAMPLES, engine=TREE, core=True),
    Case("layer-skip-chain", "layer-skip", CORE_SAMPLES, core=True),
    Case("layer-skip-tree", "layer-skip", CORE_SAMPLES, engine=TREE, core=True),
    Case("suffix-tree", "suffix"),
    Case("rest-tree", "rest"),
    Case("lookahead-tree", "lookahead"),
    Case("eagle3-chain", "eagle3"),
    Case("eagle3-tree", "eagle3", engine=TREE),
    Case("medusa-tree", "medusa"),
    Case("parallel-tree", "parallel"),
    Case("suffix-eagle3-chain", "suffix-eagle3"),
    # the planner cutting trees (deterministic trees) and sizing drafts (a costly drafter)
    Case("pld-tree-planned", "pld-tree", planned=True, lookahead=CONFIDENCE),
    Case("suffix-tree-planned", "suffix", planned=True, lookahead=CONFIDENCE),
    Case("rest-tree-planned", "rest", planned=True, lookahead=CONFIDENCE),
    Case("lookahead-tree-planned", "lookahead", planned=True, lookahead=CONFIDENCE),
    Case("draft-tree-planned", "draft", planned=True, lookahead=CONFIDENCE, engine=TREE),
    Case("parallel-tree-planned", "parallel", planned=True, lookahead=CONFIDENCE),
    # lookahead policies
    Case("pld-tree-heuristic", "pld-tree", lookahead=HEURISTIC),
    Case("draft-tree-heuristic", "draft", lookahead=HEURISTIC, engine=TREE),
    Case("draft-tree-confidence-0.2", "draft", lookahead=CONFIDENCE.model_copy(update={"confidence_threshold": 0.2}),
         engine=TREE),
    Case("layer-skip-chain-confidence", "layer-skip", lookahead=CONFIDENCE),
    # sampling warps
    Case("draft-tree-t0.6", "draft", groups=(RequestGroup(SamplingParams(0.6)),), engine=TREE),
    Case("draft-tree-top-k4", "draft", groups=(RequestGroup(SamplingParams(1.0, top_k=4)),), engine=TREE),
    Case("draft-tree-top-p0.8", "draft", groups=(RequestGroup(SamplingParams(1.0, top_p=0.8)),), engine=TREE),
    Case("layer-skip-tree-t1.3-k6-p0.9", "layer-skip", groups=(RequestGroup(SamplingParams(1.3, top_k=6, top_p=0.9)),),
         engine=TREE),
    Case("pld-tree-t0.8-k3", "pld-tree", groups=(RequestGroup(SamplingParams(0.8, top_k=3)),)),
    # penalties and a grammar, which change the target's distribution at every node given its path
    # (temperature 0.6: the likeliest first token is common enough to test what follows it on its own)
    Case("draft-tree-penalties", "draft", groups=(RequestGroup(SamplingParams(0.6), penalties=PENALTIES),), engine=TREE),
    Case("pld-tree-penalties", "pld-tree", groups=(RequestGroup(SamplingParams(0.6), penalties=PENALTIES),)),
    Case("draft-tree-grammar", "draft", groups=(RequestGroup(rule=ALTERNATION),), engine=TREE),
    Case("pld-tree-grammar-penalties", "pld-tree", groups=(
        RequestGroup(SamplingParams(0.8), penalties=PENALTIES, rule=ALTERNATION, share=0.9),
        RequestGroup(GREEDY, penalties=PENALTIES, rule=ALTERNATION, share=0.1))),
    # a mixed batch, and pipelining
    Case("mixed-batch-draft-tree", "draft", 40_000, groups=_mixed_batch(), engine={"draft_width": 2}),
    Case("draft-tree-pipelined", "draft", engine={**TREE, "pipeline": True}),
    Case("draft-tree-tight-kv", "draft", engine={**TREE, **TIGHT_KV}),
    Case("suffix-tree-tight-kv", "suffix", engine=TIGHT_KV),
    # Ray: tensor-parallel target shards and draft actors on fake GPUs
    Case("ray-tp2-layer-skip-tree", "layer-skip", engine={"draft_width": 2},
         deployment=Deployment(ray=True, tensor_parallel_size=2)),
    Case("ray-tp2-pld-tree", "pld-tree", deployment=Deployment(ray=True, tensor_parallel_size=2)),
    Case("ray-tp2-eagle3-tree", "eagle3", engine=TREE, deployment=Deployment(ray=True, tensor_parallel_size=2)),
    Case("ray-draft-actors-pipelined", "draft", engine={**TREE, "pipeline": True},
         deployment=Deployment(ray=True, draft_actors=2)),
]
KEYED = dict(rule="keyed")
CASES += [
    # the keyed rule (seeded requests): every drafter, the planner, shaping, batching, pipelining, Ray
    Case("keyed-pld-tree", "pld-tree", **KEYED),
    Case("keyed-suffix-tree", "suffix", **KEYED),
    Case("keyed-rest-tree", "rest", **KEYED),
    Case("keyed-lookahead-tree", "lookahead", **KEYED),
    Case("keyed-draft-tree", "draft", engine=TREE, **KEYED),
    Case("keyed-layer-skip-chain", "layer-skip", **KEYED),
    Case("keyed-eagle3-tree", "eagle3", engine=TREE, **KEYED),
    Case("keyed-medusa-tree", "medusa", **KEYED),
    Case("keyed-parallel-tree", "parallel", **KEYED),
    Case("keyed-suffix-eagle3-chain", "suffix-eagle3", **KEYED),
    Case("keyed-draft-tree-planned", "draft", planned=True, lookahead=CONFIDENCE, engine=TREE, **KEYED),
    Case("keyed-pld-tree-grammar-penalties", "pld-tree", groups=(
        RequestGroup(SamplingParams(0.8), penalties=PENALTIES, rule=ALTERNATION, share=0.9),
        RequestGroup(GREEDY, penalties=PENALTIES, rule=ALTERNATION, share=0.1)), **KEYED),
    Case("keyed-mixed-batch-draft-tree", "draft", groups=_mixed_batch(), engine={"draft_width": 2}, **KEYED),
    Case("keyed-draft-tree-pipelined", "draft", engine={**TREE, "pipeline": True}, **KEYED),
    Case("keyed-draft-tree-tight-kv", "draft", engine={**TREE, **TIGHT_KV}, **KEYED),
    Case("keyed-ray-tp2-eagle3-tree", "eagle3", engine=TREE, deployment=Deployment(ray=True, tensor_parallel_size=2),
         **KEYED),
    Case("keyed-ray-draft-actors-pipelined", "draft", engine={**TREE, "pipeline": True},
         deployment=Deployment(ray=True, draft_actors=2), **KEYED),
]
CASES_BY_NAME = {case.name: case for case in CASES}
