"""Which of a draft pool's drafters stopped answering: the keeper (draft_pool.py) checks every
drafter each report_period_s and replaces one that missed `misses` checks in a row.

A check is a ping with a deadline (member_timeout_s). A drafter runs one call at a time, so a ping
waits behind a hung call and goes unanswered; each check it stays out past its deadline is a miss,
as is a ping that fails (a drafter gone for good). An answer, however late, ends the run of misses:
a busy drafter is slow, not hung. A drafter that has not answered yet is starting (loading its
model): only a failed ping counts against it. Only one ping per drafter is out at a time.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol


class _Member(Protocol):
    member_id: str
    actor: object


class MemberChecks:
    def __init__(self, timeout_s: float, misses: int):
        self.timeout_s, self.misses = timeout_s, misses
        self._pings: dict[str, tuple[Future, float]] = {}  # member id -> its ping out, and when it was sent
        self._missed: dict[str, int] = {}  # member id -> checks missed in a row
        self._started: set[str] = set()  # members that have answered a ping

    def check(self, members: Sequence[_Member]) -> list[_Member]:
        """Check every member once; those that have now missed `misses` checks in a row."""
        now = time.monotonic()
        present = {member.member_id for member in members}
        self._pings = {key: ping for key, ping in self._pings.items() if key in present}
        self._missed = {key: count for key, count in self._missed.items() if key in present}
        self._started &= present
        return [member for member in members if self._check(member, now) >= self.misses]

    def _check(self, member: _Member, now: float) -> int:
        key = member.member_id
        ping, sent = self._pings.get(key, (None, now))
        if ping is not None and ping.done() and ping.exception() is None:
            self._missed[key], ping = 0, None
            self._started.add(key)
        elif ping is not None and (ping.done() or (key in self._started and now - sent >= self.timeout_s)):
            self._missed[key] = self._missed.get(key, 0) + 1
            ping = None if ping.done() else ping  # a failed ping is sent again; one out stays out
        if ping is None:
            ping, sent = member.actor.ping.remote().future(), now
        self._pings[key] = (ping, sent)
        return self._missed.get(key, 0)
