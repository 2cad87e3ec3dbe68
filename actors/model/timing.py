"""How long a verification pass takes: the cost curve the scheduler sizes drafts with.

A pass is timed as the engine runs it: every sequence has `context` committed tokens and verifies a
chain of new tokens; the pass packs all sequences. Random token ids: the cost does not depend on
them. Every shape runs once untimed, then `repeats` rounds run each shape in turn (a burst of
other work hits all shapes alike), and each shape is summarised by `aggregate`: the median for a
report, the minimum for a curve measured at start (other work on the machine only adds time).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from actors.model.runner import ModelRunner
from speculators.proposers.base import TreeInput
from speculators.tree import chain_parents


def finish_queued_work(device: torch.device) -> None:
    """Wait for the device: GPU kernels run after the call that queued them returns, so a pass
    timed without this would measure only its launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _split(tokens: int, sequences: int) -> list[int]:
    base, extra = divmod(tokens, sequences)
    return [base + (1 if index < extra else 0) for index in range(sequences)]


def time_passes(
    runner: ModelRunner, shapes: Sequence[tuple[int, int]], context: int = 256, repeats: int = 5,
    aggregate: Callable[[list[float]], float] = statistics.median, seed: int = 0,
) -> list[float]:
    """Seconds of a pass of `tokens` new tokens over `sequences` sequences, per (tokens, sequences).

    Uses scratch sequences of its own, so it needs as many free cache slots as the widest shape and
    leaves the runner as it found it.
    """
    if any(tokens < sequences or sequences < 1 for tokens, sequences in shapes):
        raise ValueError("each timed shape needs at least one new token per sequence")
    widest = max(sequences for _, sequences in shapes)
    generator = torch.Generator().manual_seed(seed)
    ids = [f"__timing-{index}" for index in range(widest)]
    vocab = runner.vocab_size

    def tokens_of(count: int) -> list[int]:
        return torch.randint(vocab, (count,), generator=generator).tolist()

    for seq_id in ids:
        runner.add(seq_id)
    try:
        runner.forward([TreeInput(s, tokens_of(context), chain_parents(context), logits="none") for s in ids])
        for seq_id in ids:
            runner.commit(seq_id, range(context))
        inputs = [[TreeInput(ids[i], tokens_of(n), chain_parents(n)) for i, n in enumerate(_split(tokens, sequences))]
                  for tokens, sequences in shapes]
        samples: list[list[float]] = [[] for _ in shapes]
        for attempt in range(repeats + 1):
            for shape_inputs, shape_samples in zip(inputs, samples):
                began = time.perf_counter()
                runner.forward(shape_inputs)
                finish_queued_work(runner.model.device)
                if attempt:
                    shape_samples.append(time.perf_counter() - began)
                for item in shape_inputs:
                    runner.truncate(item.seq_id, context)
        return [aggregate(shape_samples) for shape_samples in samples]
    finally:
        for seq_id in ids:
            runner.remove(seq_id)
