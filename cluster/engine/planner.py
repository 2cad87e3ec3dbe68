"""Goodput-based draft sizing: each step, verify the drafted tokens that maximise the batch's
expected committed tokens per second (SmartSpec, Liu et al. 2024), down to none.

Verification cost grows with the tokens in a pass (the target's measured `CostCurve`), and a
drafted token is worth its probability of being accepted (plus, for a Lookahead decoding window
node, `DraftTree.extra_value`: what its n-grams bring later). That probability is learned online:
`Acceptance` maps a drafter's own confidence in a node (draft probability, match counts) to the
rate at which the target accepted nodes of that confidence, and `RequestAcceptance` scales it by
how one request has fared against those predictions. Nodes are taken best first (a child is never
likelier than its parent) while the batch's goodput (B + sum of kept probabilities) / T(B + kept)
still grows, so a lone request drafts more where a pass of few tokens costs about one decode step,
and a full batch drafts less or nothing once passes turn compute-bound.

A step is priced by `StepCost` (learned_cost.py): the curve corrected online by what steps really
took, so verification work the curve never timed, and the serving path around it, are paid for.
A cheap drafter's call (suffix, prompt lookup) is paid before any tree is seen, so whether to call it
at all is `DraftCallGate`'s: a call is made while what the planner's trims expect it to save is more
than what calls cost, per batch size.

Lossless sampling: a tree carrying draft probabilities (sampled from a draft model or a head) is never
trimmed here, because keeping a sampled node or not by its own value would change the
distribution it was drawn from. Deterministic trees (prompt lookup, suffix, greedy drafts) are a
function of the context alone, so any trimming keeps them lossless; so are the trees of seeded
(keyed) requests, which carry no draft probabilities: their verifier keeps exactly the drafted
tokens that are the target's own samples, whatever else was drafted.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.engine.cost import CostCurve
from cluster.engine.learned_cost import DrafterCost, StepCost
from speculators.tree import DraftTree

log = logging.getLogger(__name__)

BUCKETS = 20
PRIOR_WEIGHT = 4.0
"""Pseudo-observations behind each estimate before the target has said anything."""
DEPTH_PRIOR = 0.5
"""Acceptance assumed for a node whose drafter gives no confidence, before any observation."""
EXPLORE_EVERY, EXPLORE_BACKOFF = 16, 16
"""A costly drafter the planner stopped drafts one token after this many steps, so that what the
planner believes of it (its cost, its acceptance) keeps being measured; each such try that does not
bring drafting back doubles the wait, up to EXPLORE_BACKOFF times, so one that never pays costs
next to nothing."""


@dataclass
class _Rate:
    accepted: float
    tried: float

    @property
    def value(self) -> float:
        return self.accepted / self.tried


class Acceptance:
    """P(target accepts a node | its parent was accepted), learned from verification results: by
    the drafter's confidence in the node when it gives one, and by depth (what is expected of a
    node before it is drafted).

    Apart from those per-node rates, `reach` learns P(the accepted path goes one deeper | it reached
    this depth's parent level): what a drafter's depth is worth before it drafts. For a chain the two
    are the same; in a tree every sibling is a try and at most one is accepted, so per-node rates
    read a width-4 tree's depths up to four times lower than what drafting that deep brings."""

    def __init__(self):
        self._by_confidence = [_Rate(PRIOR_WEIGHT * (b + 0.5) / BUCKETS, PRIOR_WEIGHT) for b in range(BUCKETS)]
        self._by_depth: dict[int, _Rate] = {}
        self._reach_by_depth: dict[int, _Rate] = {}

    @staticmethod
    def _at(rates: dict[int, _Rate], depth: int) -> _Rate:
        return rates.setdefault(depth, _Rate(PRIOR_WEIGHT * DEPTH_PRIOR, PRIOR_WEIGHT))

    def _confidence_rate(self, confidence: float) -> _Rate:
        return self._by_confidence[min(int(confidence * BUCKETS), BUCKETS - 1)]

    def probability(self, confidence: float | None, depth: int) -> float:
        """One node's chance, given its parent was accepted."""
        rate = self._at(self._by_depth, depth) if confidence is None else self._confidence_rate(confidence)
        return rate.value

    def reach(self, depth: int) -> float:
        """The chance that a draft of this depth has a node accepted there, given it reached depth - 1."""
        return self._at(self._reach_by_depth, depth).value

    def observe(self, tree: DraftTree, accepted_nodes: Sequence[int]) -> None:
        """Every drafted node whose parent the target accepted was tried: accepted or not; each depth
        the tree had below the accepted path's end was one try at reaching it."""
        on_path = set(accepted_nodes)
        depths = tree.depths
        tried_depths = set()
        for node in range(1, tree.size):
            if tree.parents[node] not in on_path:
                continue
            accepted = node in on_path
            tried_depths.add(depths[node])
            confidence = _confidence(tree, node)
            rates = [self._at(self._by_depth, depths[node])]
            if confidence is not None:
                rates.append(self._confidence_rate(confidence))
            for rate in rates:
                rate.tried += 1
                rate.accepted += accepted
        reached = len(accepted_nodes) - 1
        for depth in tried_depths:
            rate = self._at(self._reach_by_depth, depth)
            rate.tried += 1
            rate.accepted += depth <= reached


@dataclass
class RequestAcceptance:
    """How one request fares against the shared predictions: observed / predicted accepted tokens,
    shrunk towards 1 (a request of code or translation accepts more than a chat reply)."""

    predicted: float = 0.0
    observed: float = 0.0

    @property
    def factor(self) -> float:
        return (self.observed + PRIOR_WEIGHT) / (self.predicted + PRIOR_WEIGHT)

    def observe(self, predicted: float, observed: int) -> None:
        self.predicted += predicted
        self.observed += observed


def _confidence(tree: DraftTree, node: int) -> float | None:
    return None if tree.confidence is None else tree.confidence[node]


def path_probabilities(tree: DraftTree, acceptance: Acceptance, factor: float = 1.0) -> list[float]:
    """P(node and all its ancestors accepted) for every node (the root: 1)."""
    probs = [1.0]
    depths = tree.depths
    for node in range(1, tree.size):
        own = min(1.0, factor * acceptance.probability(_confidence(tree, node), depths[node]))
        probs.append(probs[tree.parents[node]] * own)
    return probs


def subtree(tree: DraftTree, keep: Sequence[int]) -> DraftTree:
    """The tree restricted to `keep` (node indices that include every kept node's parent)."""
    nodes = sorted(set(keep) | {0})
    index = {node: i for i, node in enumerate(nodes)}
    confidence = None if tree.confidence is None else [tree.confidence[n] for n in nodes]
    extra = None if tree.extra_value is None else [tree.extra_value[n] for n in nodes]
    probs = None if tree.draft_probs is None else tree.draft_probs[nodes]
    return DraftTree(token_ids=[tree.token_ids[n] for n in nodes], parents=[-1] + [index[tree.parents[n]] for n in nodes[1:]],
                     draft_probs=probs, confidence=confidence, extra_value=extra)


@dataclass
class Planned:
    """One request's draft as the planner sees it."""

    tree: DraftTree
    trimmable: bool
    """False for a tree that must be verified as drafted (sampled draft probabilities: keeping a
    sampled node by its own value would change the distribution it was drawn from)."""
    factor: float = 1.0
    probs: list[float] = field(default_factory=list)


@dataclass
class Exploration:
    """When a drafter that stopped paying is tried again: after `explore_after` skipped steps, each
    try that does not bring drafting back doubling the wait (EXPLORE_EVERY, EXPLORE_BACKOFF)."""

    skipped: int = 0
    explore_after: int = EXPLORE_EVERY

    def drafting(self, pays: bool) -> None:
        """A step drafts; `pays`: because drafting pays again (not only as a try)."""
        self.skipped = 0
        if pays:
            self.explore_after = EXPLORE_EVERY

    def tries(self) -> bool:
        """A step where drafting does not pay: whether it drafts anyway, as a try."""
        self.skipped += 1
        if self.skipped < self.explore_after:
            return False
        self.skipped = 0
        self.explore_after = min(2 * self.explore_after, EXPLORE_EVERY * EXPLORE_BACKOFF)
        return True


@dataclass
class Planner:
    cost: CostCurve
    acceptance: Acceptance = field(default_factory=Acceptance)
    exploration: Exploration = field(default_factory=Exploration)
    step: StepCost = field(init=False)
    """What a step costs: the curve, corrected by the steps observed."""
    last_saving: float = 0.0
    """Seconds the last trim's plan is expected to save against decoding its expected tokens plainly."""

    def __post_init__(self):
        self.step = StepCost(self.cost)

    def trim(self, drafts: Sequence[Planned], other_tokens: int = 0, other_sequences: int = 0) -> list[DraftTree]:
        """Each draft cut to the nodes that maximise the batch's expected tokens per second; the pass
        also carries `other_tokens` tokens of `other_sequences` sequences (prompt chunks), which cost
        time and yield no output tokens."""
        sequences = len(drafts) + other_sequences
        fixed_tokens, value = len(drafts) + other_tokens, float(len(drafts))
        fixed_drafted = 0
        candidates = []  # (path probability, depth, draft index, node)
        for index, draft in enumerate(drafts):
            draft.probs = path_probabilities(draft.tree, self.acceptance, draft.factor)
            extra = draft.tree.extra_value or [0.0] * draft.tree.size
            if draft.trimmable:
                depths = draft.tree.depths
                candidates += [(-p - extra[n], depths[n], index, n) for n, p in enumerate(draft.probs) if n]
            else:
                fixed_drafted += draft.tree.num_drafted
                value += sum(draft.probs[1:]) + sum(extra[1:])
        fixed_tokens += fixed_drafted
        candidates.sort()
        best_seconds = self.step.seconds(fixed_tokens, sequences, fixed_drafted)
        best, best_count, best_value = value / best_seconds, 0, value
        for count, (negative, _, _, _) in enumerate(candidates, start=1):
            value -= negative
            seconds = self.step.seconds(fixed_tokens + count, sequences, fixed_drafted + count)
            if value / seconds > best:
                best, best_count, best_value, best_seconds = value / seconds, count, value, seconds
        self.last_saving = self._saving(len(drafts), best_value, best_seconds, other_tokens, sequences)
        kept: list[list[int]] = [[] for _ in drafts]
        for _, _, index, node in candidates[:best_count]:
            kept[index].append(node)
        return [subtree(d.tree, kept[i]) if d.trimmable else d.tree for i, d in enumerate(drafts)]

    def _saving(self, decoding: int, value: float, seconds: float, other_tokens: int, sequences: int) -> float:
        """Seconds a step of expected `value` output tokens taking `seconds` saves against plain decoding:
        its tokens past one a request, at what a plain step spends a token, less the seconds it adds."""
        if not decoding:
            return 0.0
        per_token = self.step.seconds(decoding, decoding) / decoding
        return (value - decoding) * per_token - (seconds - self.step.seconds(decoding + other_tokens, sequences))

    def depth(self, sequences: int, cap: int, drafter: DrafterCost) -> int:
        """How deep a costly drafter (a draft model, a trained head) should draft for a batch, before
        it drafts: the common depth that maximises expected tokens per second of drafting plus
        verifying, with the acceptance learned at each depth so far. A step that drafts pays the
        drafter's call: catching up on the tokens committed per step, and drafting. When no depth
        pays, a step now and then still drafts one token (see EXPLORE_EVERY)."""
        best, best_depth = sequences / self.step.seconds(sequences, sequences), 0
        value, path = float(sequences), 1.0
        for depth in range(1, cap + 1):
            path *= self.acceptance.reach(depth)
            value += sequences * path
            drafted = sequences * depth
            seconds = self.step.seconds(sequences + drafted, sequences, drafted) + drafter.seconds(value, depth)
            if value / seconds > best:
                best, best_depth = value / seconds, depth
        if best_depth or not cap:
            self.exploration.drafting(pays=bool(best_depth))
            return best_depth
        return int(self.exploration.tries())


CALL_AVERAGING = 0.2
"""Weight of the newest step in DraftCallGate's averages."""


@dataclass
class _CallRecord:
    saving: float | None = None
    """Average seconds a call's trimmed drafts were expected to save (None before the first call)."""
    cost: float = 0.0
    """Average seconds a call cost the engine's thread: building and sending it, waiting for its trees."""
    exploration: Exploration = field(default_factory=Exploration)
    paid: bool = True


class DraftCallGate:
    """Whether a cheap drafter (suffix, prompt lookup, REST, ...) is called this step.

    Its call costs the engine a few milliseconds whatever the planner keeps of its trees (an actor's
    round trip, the drafting itself), and at a load where the planner keeps little, that is more
    than the drafts save: speculation then runs slower than plain decoding. So each batch size
    (bucketed in powers of two) averages what its calls cost and what its trims expected them to
    save, and a call is made while the saving is the larger. A bucket whose calls stopped paying
    still calls now and then (EXPLORE_EVERY, backing off as Planner.depth does), so a change of
    prompts or load that makes drafting pay again is seen.
    """

    def __init__(self):
        self._buckets: dict[int, _CallRecord] = {}

    def _record(self, sequences: int) -> _CallRecord:
        return self._buckets.setdefault(sequences.bit_length(), _CallRecord())

    def calls(self, sequences: int) -> bool:
        """Whether a batch of `sequences` requests calls the drafter this step."""
        record = self._record(sequences)
        if record.saving is None or record.saving > record.cost:
            record.exploration.drafting(pays=False)  # paying: `observe` resets the wait
            return True
        return record.exploration.tries()

    def observe(self, sequences: int, saving: float, cost: float) -> None:
        """A step of `sequences` requests called the drafter: its trims expected `saving` seconds; the call cost `cost`."""
        record = self._record(sequences)
        if record.saving is None:
            record.saving, record.cost = saving, cost
        else:
            record.saving += CALL_AVERAGING * (saving - record.saving)
            record.cost += CALL_AVERAGING * (cost - record.cost)
        pays = record.saving > record.cost
        if pays:
            record.exploration.drafting(pays=True)
        if pays != record.paid:
            record.paid = pays
            low = 1 << (sequences.bit_length() - 1)
            log.info("drafter calls %s for batches of %d-%d requests: their drafts are expected to save %.2f ms a "
                     "step, a call costs %.2f ms", "resume" if pays else "stop", low, 2 * low - 1,
                     1000 * record.saving, 1000 * record.cost)
