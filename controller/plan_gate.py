"""How much planning one API process does at once (docs/security.md, "Tenants and the pool").

A plan is up to seconds of CPU in the API's thread pool; 40 viewers planning at once pushed
`/readyz` to a 5 s p99. So at most `concurrency` plans run at a time (one more gets 429 at
once, not a place in a queue that holds a connection), and each token's owner may start at
most `per_minute` a minute.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from contextlib import contextmanager


class PlanRefused(Exception):
    """429: `detail` says why, `retry_after_s` when to try again."""

    def __init__(self, detail: str, retry_after_s: int):
        self.detail, self.retry_after_s = detail, retry_after_s


class PlanGate:
    def __init__(self, concurrency: int = 2, per_minute: int = 60):
        self.concurrency, self.per_minute = concurrency, per_minute
        self.running = 0
        self._started: dict[str, deque[float]] = defaultdict(deque)

    @contextmanager
    def admit(self, owner: str):
        """Hold one of the planner's slots while the plan runs; PlanRefused when there is
        none or `owner` planned too often. The event loop's thread calls it: no lock."""
        now = time.monotonic()
        recent = self._started[owner]
        while recent and now - recent[0] >= 60:
            recent.popleft()
        if len(recent) >= self.per_minute:
            wait = int(60 - (now - recent[0])) + 1
            raise PlanRefused(
                f"{owner!r} started {len(recent)} plans in the last minute (at most "
                f"{self.per_minute}); retry in {wait}s",
                wait,
            )
        if self.running >= self.concurrency:
            raise PlanRefused(
                f"the planner is busy ({self.running} plans running, at most "
                f"{self.concurrency} at once); retry in a second",
                1,
            )
        recent.append(now)
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
