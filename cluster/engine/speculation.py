"""How much speculation each request gets: the engine's one owner of draft length.

The engine asks the `SpeculationController` three things a step: what each request of a micro-batch
drafts (`drafts`), what of the drafted trees is verified (`trim`), and it tells it what the target
accepted (`observe`) and what the draft call cost (`observe_drafter`). Behind it:

- per request (`RequestSpeculation`): its lookahead policy (speculators/lookahead.py), its acceptance
  gate (below) and how it fares against the shared acceptance predictions (`RequestAcceptance`);
- per engine: the goodput planner over the target's cost curve corrected by observed steps
  (planner.py, learned_cost.py), which cuts trees to what pays and tells a costly drafter how deep
  to draft, with that drafter's learned cost; for a cheap drafter, the gate on calling it at all
  (`DraftCallGate`): its call costs the same whatever the planner keeps.

A request's own lookahead only bounds what it drafts; the planner, when on, decides what pays.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cluster.engine.config import SchedulerConfig
from cluster.engine.cost import CostCurve
from cluster.engine.learned_cost import DrafterCost
from cluster.engine.planner import DraftCallGate, Planned, Planner, RequestAcceptance, path_probabilities
from cluster.engine.request import GenerationRequest
from cluster.engine.sequence import ActiveRequest
from cluster.engine.stats import EngineCounters
from speculators.lookahead import LookaheadPolicy, make_policy
from speculators.proposers.base import DraftRequest, VerifiedTree
from speculators.tree import DraftTree
from speculators.verify import VerifyResult

MAX_COOLOFF_DOUBLINGS = 4
"""A gate that keeps closing waits at most 2**4 = 16 times its base cooloff between retries."""


@dataclass
class SpeculationGate:
    """Switches speculation off for a request whose drafts keep being rejected, then retries.

    Tracks an exponential average of the fraction of drafted depth the target accepted; once closed
    it stays closed for `cooloff_steps` steps. Every retry pays `warmup_steps` drafted steps, so a
    retry that fails again doubles the wait (up to MAX_COOLOFF_DOUBLINGS times): a drafter that
    never fits a request costs it a few steps, not one in three. A retry that stays open for
    `cooloff_steps` drafted steps resets the wait.
    """

    min_acceptance: float
    warmup_steps: int
    cooloff_steps: int
    average: float = 1.0
    drafted_steps: int = 0
    off_for: int = 0
    failed_retries: int = 0

    @property
    def is_open(self) -> bool:
        return self.off_for == 0

    def observe(self, drafted_depth: int, accepted: int) -> None:
        """Called once per step of the request."""
        if self.off_for > 0:
            self.off_for -= 1
            return
        if drafted_depth == 0:
            return
        self.drafted_steps += 1
        self.average = 0.7 * self.average + 0.3 * (accepted / drafted_depth)
        if self.drafted_steps < self.warmup_steps:
            return
        if self.average < self.min_acceptance:
            self.off_for = self.cooloff_steps * 2 ** min(self.failed_retries, MAX_COOLOFF_DOUBLINGS)
            self.failed_retries += 1
            self.average, self.drafted_steps = 1.0, 0
        elif self.drafted_steps >= self.cooloff_steps:  # open long enough: the retry held
            self.failed_retries = 0


@dataclass
class RequestSpeculation:
    """What one request's drafts are bounded by and learned from, made by the controller at admission."""

    policy: LookaheadPolicy
    gate: SpeculationGate
    acceptance: RequestAcceptance = field(default_factory=RequestAcceptance)
    verified: VerifiedTree | None = None
    """Its last verified tree with the target's choice at every node, when the drafter reads them,
    until its next draft request carries it."""


class SpeculationController:
    """Every decision on draft length in one place, so that a verification result reaches each learner
    once and in one order, and the engine only asks and tells."""

    def __init__(self, config: SchedulerConfig, cost: CostCurve | None = None, costly_drafter: bool = False,
                 counters: EngineCounters | None = None):
        self.config = config
        self.counters = counters or EngineCounters()
        self.planner = None if cost is None else Planner(cost)
        """Goodput-based sizing over the target's cost curve; None: every request drafts what its
        lookahead allows and every tree is verified as drafted."""
        self.costly_drafter = costly_drafter
        """A draft model or trained head, which pays per drafted depth: told how deep to draft before it runs."""
        self.drafter_cost = DrafterCost()
        self.call_gate = DraftCallGate() if self.planner is not None and not costly_drafter else None
        """Whether a cheap drafter is called this step (a costly one is told its depth instead, down to none)."""

    def for_request(self, request: GenerationRequest) -> RequestSpeculation:
        config = self.config
        gate = SpeculationGate(config.min_acceptance, config.gate_warmup_steps, config.gate_cooloff_steps)
        return RequestSpeculation(make_policy(request.lookahead or config.lookahead), gate)

    def drafts(self, states: Sequence[ActiveRequest]) -> list[DraftRequest]:
        """The DraftRequests of one micro-batch; requests that do not speculate this step are left out.

        Each request drafts what its lookahead, its gate, the room left in its output and cache and
        (when set) its share of `step_token_budget` allow. For a costly drafter the planner's depth
        bounds every request; a request's own lookahead bounds it further, never lifts the cap. A
        cheap drafter is not called at a batch size where its calls cost more than they save.
        """
        if self.call_gate is not None and not self.call_gate.calls(len(states)):
            self.counters.draft_calls_skipped += 1
            return []
        depth_cap = None
        if self.planner is not None and self.costly_drafter:
            cap = max((s.speculation.policy.depth() for s in states), default=0)
            depth_cap = self.planner.depth(len(states), cap, self.drafter_cost)
        config = self.config
        speculating = [s for s in states if speculates(s)]
        if not speculating:
            return []
        budget = config.step_token_budget
        share = config.max_tree_nodes if budget is None else budget // len(speculating)
        drafts = []
        for state in speculating:
            request, policy = state.request, state.speculation.policy
            remaining = request.max_new_tokens - len(state.output)
            room = config.max_len - len(state.tokens) - 1  # cache positions left after the root
            depth = min(policy.depth(), remaining - 1, room)
            if depth_cap is not None:
                depth = min(depth, depth_cap)
            nodes = min(config.max_tree_nodes, share, room)
            if depth > 0 and nodes > 0:
                drafts.append(DraftRequest(request_id=request.request_id, token_ids=list(state.tokens),
                                           num_speculative_tokens=depth, max_nodes=nodes,
                                           confidence_threshold=policy.confidence_threshold, sampling=request.sampling,
                                           penalties=request.penalties, prompt_length=len(request.prompt_ids),
                                           cache_scope=request.cache_scope, verified=state.speculation.verified))
            state.speculation.verified = None
        return drafts

    def observe_drafter(self, rows: int, trees: Iterable[DraftTree], seconds: float) -> None:
        """A draft call's wall time: `rows` tokens caught up on, `trees` its usable trees. Only a costly
        drafter's is learned (what the planner's depth weighs against verifying)."""
        if self.costly_drafter:
            depth = max((tree.max_depth for tree in trees), default=0)
            self.drafter_cost.observe(rows, depth, seconds)

    def trim(self, parts: Sequence[tuple[Sequence[ActiveRequest], list[DraftTree], Sequence[tuple[str, int]]]],
             call_seconds: float | None = None) -> list[DraftTree]:
        """Trees cut to what pays this step (all of them verified as drafted without a planner), for
        each part of the pass priced on its own: (requests, their trees, the prompt chunks that share
        its pass). A request's own lookahead only bounded what was drafted; the planner still keeps
        what pays. `call_seconds`: what the engine spent on this step's draft call, None if it made none."""
        if self.planner is None:
            return [tree for _, trees, _ in parts for tree in trees]
        kept, saving = [], 0.0
        for states, trees, chunks in parts:
            if trees:
                kept += self.planner.trim([
                    Planned(tree, trimmable=tree.draft_probs is None, factor=state.speculation.acceptance.factor)
                    for state, tree in zip(states, trees)
                ], sum(count for _, count in chunks), len(chunks))
                saving += self.planner.last_saving
        if call_seconds is not None and self.call_gate is not None:
            self.call_gate.observe(sum(len(states) for states, _, _ in parts), saving, call_seconds)
        return kept

    def observe_step(self, states: Sequence[ActiveRequest], trees: Sequence[DraftTree],
                     chunks: Sequence[tuple[str, int]], seconds: float) -> None:
        """A verification step (these requests' trees, these prompt chunks) took `seconds`: for the
        planner's price of a step."""
        if self.planner is not None:
            sequences = len({s.request_id for s in states} | {seq_id for seq_id, _ in chunks})
            tokens = sum(tree.size for tree in trees) + sum(count for _, count in chunks)
            self.planner.step.observe(tokens, sequences, sum(tree.num_drafted for tree in trees), seconds)

    def observe(self, state: ActiveRequest, tree: DraftTree, result: VerifyResult) -> None:
        """One verification of the request's tree, for its lookahead, its gate and the acceptance learned."""
        speculation = state.speculation
        accepted, depth = len(result.accepted_tokens), _judged_depth(tree)
        speculation.policy.observe(depth, accepted)
        speculation.gate.observe(depth, accepted)
        if result.predictions is not None:
            speculation.verified = VerifiedTree(list(tree.token_ids), list(tree.parents), result.predictions)
        if self.planner is not None and tree.num_drafted:
            acceptance = self.planner.acceptance
            speculation.acceptance.observe(sum(path_probabilities(tree, acceptance)[1:]), accepted)
            acceptance.observe(tree, result.accepted_nodes)


def _judged_depth(tree: DraftTree) -> int:
    """The drafted depth a request's lookahead and gate judge by what the target accepted: that of
    the nodes drafted for their own acceptance. Nodes worth mostly later tokens (a Lookahead decoding
    window's, `DraftTree.extra_value`) are left to the planner, which weighs that worth against their
    cost: a gate shut by their rejections would stop the Jacobi iterations that fill the pool."""
    if tree.extra_value is None:
        return tree.max_depth
    return max((depth for depth, extra in zip(tree.depths, tree.extra_value) if not extra), default=0)


def speculates(state: ActiveRequest) -> bool:
    """Whether the request drafts this step: it asked to and its gate is open."""
    return state.request.speculate and state.speculation.gate.is_open
