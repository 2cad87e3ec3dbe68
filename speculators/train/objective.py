"""The objective of each head this project trains, by kind."""
from __future__ import annotations

from speculators.train.dflash import ANCHORS, DFlashObjective
from speculators.train.eagle3 import Eagle3Objective
from speculators.train.medusa import MedusaObjective


def head_objective(kind: str, module, ttt_steps: int = 3, anchors: int = ANCHORS):
    """What training minimises and evaluation reports for an `eagle3`, `medusa` or `dflash` drafter."""
    if kind == "eagle3":
        return Eagle3Objective(module, ttt_steps)
    return MedusaObjective(module) if kind == "medusa" else DFlashObjective(module, anchors)
