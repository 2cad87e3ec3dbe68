"""What each request drafts in a step, before the drafter runs: its lookahead, its gate, the room
left in its output and cache, and (when set) its share of a fixed token budget."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from cluster.engine.config import SchedulerConfig
from cluster.engine.sequence import ActiveRequest
from speculators.proposers.base import DraftRequest


def draft_requests(states: Sequence[ActiveRequest], config: SchedulerConfig,
                   depth_cap: int | None = None) -> list[DraftRequest]:
    """The DraftRequests of one micro-batch; requests that do not speculate this step are left out.

    `depth_cap` (the planner's depth for a costly drafter) bounds every request; a request's own
    lookahead (policy, `num_speculative_tokens`) bounds it further, never lifts the planner's cap.
    """
    speculating = [s for s in states if s.request.speculate and s.gate.is_open]
    if not speculating:
        return []
    budget = config.step_token_budget
    share = config.max_tree_nodes if budget is None else budget // len(speculating)
    drafts = []
    for state in speculating:
        request = state.request
        remaining = request.max_new_tokens - len(state.output)
        room = config.max_len - len(state.tokens) - 1  # cache positions left after the root
        depth = min(state.policy.depth(), remaining - 1, room)
        if depth_cap is not None:
            depth = min(depth, depth_cap)
        nodes = min(config.max_tree_nodes, share, room)
        if depth > 0 and nodes > 0:
            drafts.append(DraftRequest(request.request_id, list(state.tokens), depth, nodes,
                                       state.policy.confidence_threshold, request.sampling,
                                       penalties=request.penalties, prompt_length=len(request.prompt_ids),
                                       cache_scope=request.cache_scope))
    return drafts


class SentTokens:
    """What one draft worker already has of each request, so that a call carries only new tokens."""

    def __init__(self):
        self._sent: dict[str, int] = {}

    def outgoing(self, requests: Sequence[DraftRequest]) -> list[DraftRequest]:
        """The requests as sent: each request's tokens past what this worker has."""
        sent = []
        for request in requests:
            start = min(self._sent.get(request.request_id, 0), len(request.token_ids) - 1)
            sent.append(replace(request, token_ids=list(request.token_ids[start:]), start=start))
            self._sent[request.request_id] = len(request.token_ids)
        return sent

    def forget(self, request_ids: Sequence[str] | None = None) -> None:
        """Send these requests (None: all) whole next time: finished, or the worker lost them."""
        if request_ids is None:
            self._sent.clear()
        for request_id in request_ids or ():
            self._sent.pop(request_id, None)
