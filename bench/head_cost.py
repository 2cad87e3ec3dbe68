"""What one call of the committed EAGLE-3 head costs, alone: catch up on one committed token and
draft to depth d (0, 1, 2, 4), as a chain and as the width-4 tree; median of 15 calls over a
300-token context. The planner fits the same cost from the engine's own calls; this is the figure
to hold that fit against.

    .venv/bin/python -m bench.head_cost [--draft FOLDER]   (a candidate head instead of the committed one)
"""
from __future__ import annotations

import argparse
import time

import torch

from actors.model.heads import head_proposer, resolve_head
from actors.model.loader import DEFAULT_MODEL, load_config, load_model, resolve_model
from speculators.hidden import TargetHidden
from speculators.proposers.base import DraftRequest

CONTEXT, CALLS = 300, 15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="eagle3:" + DEFAULT_MODEL, help="a head folder or trained head name")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_model(DEFAULT_MODEL)
    config = load_config(resolve_model(DEFAULT_MODEL))
    source = resolve_head("eagle3", args.draft, DEFAULT_MODEL)
    for width in (1, 4):
        proposer = head_proposer("eagle3", source, config, DEFAULT_MODEL, width, None, target, torch.float32, "cpu")
        columns = config.hidden_size * len(proposer.hidden_layers)  # the three target layers side by side
        tokens = torch.randint(1000, (CONTEXT,)).tolist()
        proposer.propose([DraftRequest(request_id="r", token_ids=tokens, num_speculative_tokens=0, max_nodes=0,
                                       hidden=TargetHidden(0, torch.randn(CONTEXT - 1, columns)))])
        for depth in (0, 1, 2, 4):
            times = []
            for _ in range(CALLS):
                tokens = tokens + [int(torch.randint(1000, ()))]
                latest = TargetHidden(len(tokens) - 2, torch.randn(1, columns))
                request = DraftRequest(request_id="r", token_ids=tokens, num_speculative_tokens=depth, max_nodes=32,
                                       hidden=latest)
                began = time.perf_counter()
                proposer.propose([request])
                times.append(time.perf_counter() - began)
            print(f"width {width}, depth {depth}: {sorted(times)[CALLS // 2] * 1000:.2f} ms")


if __name__ == "__main__":
    main()
