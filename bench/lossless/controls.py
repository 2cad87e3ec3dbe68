"""Negative controls: verifiers with a deliberate mistake, which the cases they concern must fail.

Each mistake replaces one named step of speculators.verify (or of speculators.shaping or
speculators.keyed) for the duration of a run (in this process: the controls run on in-process
engines), so the real verifier's code stays as it is and a control breaks exactly one rule. A
fresh copy of the mistake is applied to each run of the engine (its state, if any, starts anew).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import ModuleType
from unittest import mock

import torch

from speculators import keyed, shaping, verify
from speculators.tree import DraftTree


def _with_replacement(q: torch.Tensor, token: int) -> torch.Tensor:
    """Siblings treated as if drawn with replacement: a rejected token stays in q."""
    return q


def _residual_not_renormalised(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """max(p - q, 0) left as it is (q a point mass on `token` when None)."""
    point = torch.nn.functional.one_hot(torch.tensor(token), p.shape[-1]).to(p.dtype)
    return (p - (point if q is None else q)).clamp_min(0)


def _inverted_ratio(p_token: float, q_token: float) -> float:
    """min(1, q/p) instead of min(1, p/q)."""
    return 1.0 if p_token <= 0 else min(1.0, q_token / p_token)


def _paths_ignored(tree: DraftTree) -> list[list[int]]:
    """Penalties at every node counted as at the root: the drafted tokens above a node forgotten."""
    return [[] for _ in range(tree.size)]


def _keyed_by_step(tree: DraftTree, target_probs: torch.Tensor, seed: int, position: int):
    """Every token of a verification pass sampled with the noise of the pass's first position."""
    return verify._walk(tree, lambda node, depth: keyed.keyed_sample(target_probs[node], seed, position))


def _keyed_by_draw_count() -> Callable:
    """Noise keyed by how many noise vectors the request drew so far (drafter and verifier alike, as
    one random stream per request would be) instead of by position."""
    real, draws = keyed.keyed_exponential, {}

    def faulty(seed: int, position: int, size: int, device="cpu") -> torch.Tensor:
        draws[seed] = draws.get(seed, -1) + 1
        return real(seed, draws[seed], size, device)

    return faulty


@dataclass(frozen=True)
class Control:
    name: str
    replaces: dict[str, Callable]
    """Function name in `module` -> the faulty version, or a maker of it (`made`)."""
    cases: tuple[str, ...]
    """The cases whose trees the mistake touches: each must fail under it."""
    module: ModuleType = verify
    made: bool = False
    """`replaces` holds makers: each application gets a fresh faulty function (one with state)."""

    @contextmanager
    def applied(self) -> Iterator[None]:
        with ExitStack() as stack:
            for name, faulty in self.replaces.items():
                stack.enter_context(mock.patch.object(self.module, name, faulty() if self.made else faulty))
            yield


CONTROLS = [
    Control("sampled tree verified as if drawn with replacement", {"_without": _with_replacement},
            ("layer-skip-tree", "draft-tree")),
    Control("residual not renormalised after a rejected sibling", {"_residual": _residual_not_renormalised},
            ("draft-tree", "pld-tree")),
    Control("draft token accepted with min(1, q/p)", {"_acceptance": _inverted_ratio},
            ("pld-chain", "draft-chain", "layer-skip-chain")),
    Control(name="penalties at every tree node counted without the drafted tokens above it",
            replaces={"path_tokens": _paths_ignored}, cases=("pld-tree-penalties", "draft-tree-penalties"), module=shaping),
    Control("keyed noise of a pass's first position used for all its tokens", {"verify_keyed": _keyed_by_step},
            ("keyed-pld-tree", "keyed-draft-tree")),
    Control(name="keyed noise by draw count instead of position", replaces={"keyed_exponential": _keyed_by_draw_count},
            cases=("keyed-draft-tree", "keyed-eagle3-tree"), module=keyed, made=True),
]
