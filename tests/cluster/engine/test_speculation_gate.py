"""The acceptance gate: a request whose drafts keep failing stops speculating, and retries ever
less often while they keep failing."""
from __future__ import annotations

from cluster.engine.speculation import MAX_COOLOFF_DOUBLINGS, SpeculationGate


def closed_steps_between_retries(gate: SpeculationGate, accepted: int, steps: int) -> list[int]:
    """Run `steps` steps drafting 4 tokens each while open; the lengths of the closed spells."""
    spells, closed = [], 0
    for _ in range(steps):
        if gate.is_open:
            if closed:
                spells.append(closed)
                closed = 0
            gate.observe(4, accepted)
        else:
            closed += 1
            gate.observe(0, 0)
    return spells


def test_a_gate_whose_retries_keep_failing_waits_twice_as_long_each_time_up_to_a_cap():
    gate = SpeculationGate(min_acceptance=0.1, warmup_steps=4, cooloff_steps=16)
    spells = closed_steps_between_retries(gate, accepted=0, steps=2000)
    cap = 16 * 2 ** MAX_COOLOFF_DOUBLINGS
    assert spells[:6] == [16, 32, 64, 128, cap, cap]


def test_a_gate_stays_open_while_drafts_are_accepted_and_a_retry_that_holds_resets_the_wait():
    gate = SpeculationGate(min_acceptance=0.1, warmup_steps=4, cooloff_steps=16)
    assert closed_steps_between_retries(gate, accepted=2, steps=200) == []
    closed_steps_between_retries(gate, accepted=0, steps=4 + 16 + 4 + 32)  # closed twice
    assert gate.failed_retries == 2
    while not gate.is_open:
        gate.observe(0, 0)
    for _ in range(16):
        gate.observe(4, 3)
    assert gate.is_open and gate.failed_retries == 0
    assert closed_steps_between_retries(gate, accepted=0, steps=30) == [16]
