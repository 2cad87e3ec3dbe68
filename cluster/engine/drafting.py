"""What each request drafts in a step: its lookahead, its gate, and its share of the step's budget."""
from __future__ import annotations

from collections.abc import Sequence

from cluster.engine.config import SchedulerConfig
from cluster.engine.sequence import ActiveRequest
from speculators.proposers.base import DraftRequest


def draft_requests(states: Sequence[ActiveRequest], config: SchedulerConfig) -> list[DraftRequest]:
    """The DraftRequests of one micro-batch; requests that do not speculate this step are left out."""
    speculating = [s for s in states if s.request.speculate and s.gate.is_open]
    if not speculating:
        return []
    share = config.step_token_budget // len(speculating)
    drafts = []
    for state in speculating:
        request = state.request
        remaining = request.max_new_tokens - len(state.output)
        room = config.max_len - len(state.tokens) - 1  # cache positions left after the root
        depth = max(0, min(state.policy.depth(), remaining - 1, room))
        nodes = max(0, min(config.max_tree_nodes, share, room))
        if depth and nodes:
            drafts.append(DraftRequest(request.request_id, list(state.tokens), depth, nodes,
                                       state.policy.confidence_threshold, request.sampling))
    return drafts
