"""What fits in a target worker's KV blocks: its fit policy, in one place.

The worker owns the blocks, so it decides (the engine only offers and resumes, cluster/engine/scheduler.py):
- A prompt larger than the whole cache is never admitted.
- A request is admitted while its blocks leave a watermark of 1% of the blocks (plus one) free, room
  for the running requests' trees to grow; a request that would run alone always is.
- When a verify call's trees do not fit, the newest requests (in admission order: running or still
  prefilling, in the call or not, so with pipelining the other micro-batch's too) are preempted
  until the call's remaining trees fit; the oldest is always kept, so one progresses (a call whose
  items are all newer than it may then verify none of them: its pass still prefills).
Every rank of a tensor-parallel group gets the same calls in the same order and so decides the same.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from actors.model.block_pool import BlockPool


class BlockFit:
    def __init__(self, pool: BlockPool):
        self.pool = pool

    def ever_fits(self, blocks: int) -> bool:
        return blocks <= self.pool.num_blocks

    def admits(self, blocks: int, alone: bool) -> bool:
        """Whether a request taking `blocks` more may start (`alone`: no other request is admitted)."""
        return alone or blocks + self.pool.num_blocks // 100 + 1 <= self.pool.available

    def make_room(self, needed: dict[str, int], oldest_first: Sequence[str], free: Callable[[str], None]) -> list[str]:
        """`free` the newest of `oldest_first` until the trees' `needed` blocks fit, keeping the
        oldest; the ids freed, newest first."""
        needed, newest_first, freed = dict(needed), list(reversed(oldest_first)), []
        while sum(needed.values()) > self.pool.available and len(newest_first) > 1:
            victim = newest_first.pop(0)
            free(victim)
            needed.pop(victim, None)
            freed.append(victim)
        return freed
