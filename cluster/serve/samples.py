"""The engine requests behind one call's choices (`n`, `best_of`), and which outputs become choices."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.request import GenerationOutput, GenerationRequest


@dataclass
class Samples:
    requests: list[GenerationRequest]
    """One request whose output every choice copies (a deterministic call), or one per sample."""
    n: int
    """Choices returned."""

    def choice_indices(self, request_index: int) -> range:
        """The choices a request's events belong to (streaming: never more requests than choices)."""
        return range(self.n) if len(self.requests) == 1 else range(request_index, request_index + 1)

    def choices(self, outputs: list[GenerationOutput]) -> list[GenerationOutput]:
        """The `n` outputs returned, in choice order: copies of the one output, every sample, or the
        `n` samples of `best_of` with the highest cumulative log-probability (vLLM's ranking)."""
        if len(outputs) == 1:
            return outputs * self.n
        ranked = sorted(outputs, key=cumulative_logprob, reverse=True) if len(outputs) > self.n else outputs
        return ranked[:self.n]


def cumulative_logprob(output: GenerationOutput) -> float:
    """The sum of the output's tokens' log-probabilities under the target (raw, see speculators.logprobs)."""
    return sum(entry.logprob for entry in output.logprobs or ())
