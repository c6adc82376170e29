"""Redis's availability as this controller sees it, so that silence is judged fairly
(docs/architecture.md, "Failure handling").

A worker's heartbeat age means "this worker is gone" only if Redis could take its beats all
along. When Redis stalls (SIGSTOP, a long fork, a full disk, a partition) or restarts, every
agent's beats stop at once, and the first `TIME` after the stall makes every worker look
silent. Agents cannot tell the controller about that, but the controller saw the same stall
in its own round trips. So:

- a thread of its own (`watch`, started by controller/service.py) makes one timed round trip
  every `PROBE_S`, whatever the reconcile pass is doing: a pass that takes long (a
  1,024-rank recovery written, issue 15) is not a gap, since Redis took beats all along;
- a gap is an interval between two successful round trips: calls failing, one slow call, the
  whole controller stopped or starved of CPU all show up as one; so does the interval since
  the last success while it is still open (a round trip in flight, or overdue), so a judge
  that reads Redis right after a stall never runs ahead of the watcher's record of it;
- a Redis restart (`uptime_in_seconds`) counts as a gap back to the moment it started, and
  so does this controller's own start (it knows nothing of what came before);
- `steady(window_s, gap_s)`: Redis has been available for the whole last `window_s`, with no
  gap longer than `gap_s` in it. The scheduler judges a job's heartbeat ages and progress only
  while `steady(dead_after_s, dead_after_s / 2)` holds: after a stall, the agents get a full
  `dead_after_s` of working Redis to beat again before anyone's silence counts.

Why `dead_after_s / 2` for the gap: the spec requires `heartbeat_s <= dead_after_s / 2`, so a
beat is at most `heartbeat_s` old when a stall begins, and a stall shorter than
`dead_after_s / 2` leaves every healthy worker's beat younger than `dead_after_s` (beats in
flight during the stall are stamped when Redis resumes). A longer one makes judging wait.

Everything here is local monotonic time (durations only); heartbeat ages themselves stay in
Redis server time. A controller starved of CPU looks like a gap too (its watcher is late):
that only delays judging, it never causes a false death.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

import redis

log = logging.getLogger("meshkeeper.availability")

PROBE_S = 0.1  # the watcher's period: well under the tightest dead_after_s / 2 (0.5 s)
GAP_FLOOR_S = 0.4  # shorter intervals are ordinary scheduling noise, not worth keeping
LOG_GAP_S = 1.0  # a gap without errors this long is logged
KEEP_GAPS = 4096  # even at one a second (a starved controller), over an hour of history


class RedisAvailability:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last_ok: float | None = None  # when the last successful round trip was answered
        self._gaps: deque[tuple[float, float]] = deque(maxlen=KEEP_GAPS)  # (ended at, length)
        self._redis_started: float | None = None  # local estimate of when redis-server started
        self._down_since: float | None = None  # first failure of the current outage
        self.gaps = self.restarts = 0  # counters, for logs and tests
        self._lock = threading.Lock()  # the watcher records, the reconcile pass asks

    # -- observations -----------------------------------------------------------------
    def watch(self, store, stop: threading.Event, every_s: float = PROBE_S) -> None:
        """Probe `store` every `every_s` until `stop` is set: the body of the controller's
        watcher thread. Failures are recorded (and logged once per outage), never raised."""
        while not stop.wait(every_s):
            try:
                self.probe(store)
            except redis.RedisError:
                pass  # recorded by probe: judging waits until Redis is back for a window

    def probe(self, store) -> None:
        """One timed round trip (INFO server: also tells a restart). Raises RedisError after
        recording the failure."""
        try:
            uptime = store.uptime_s()
        except redis.RedisError as e:
            self.failed(e)
            raise
        self.answered(uptime)

    def answered(self, uptime_s: int | None = None) -> None:
        """A round trip just succeeded; `uptime_s` is redis-server's uptime if it told us."""
        with self._lock:
            self._answered(uptime_s)

    def _answered(self, uptime_s: int | None) -> None:
        now = self._clock()
        if self._last_ok is None:
            self._gaps.append((now, math.inf))  # this controller's start: nothing known before
            log.info(
                "Redis reachable; heartbeat silence is judged once it has stayed so for "
                "a job's dead_after_s"
            )
        else:
            gap = now - self._last_ok
            if gap > GAP_FLOOR_S:
                self._gaps.append((now, gap))
            if self._down_since is not None:
                self.gaps += 1
                log.warning(
                    "Redis is back after %.1fs without a successful round trip; heartbeat "
                    "and progress silence is not judged until it has stayed up for a "
                    "job's dead_after_s",
                    gap,
                )
            elif (
                gap > LOG_GAP_S
            ):  # a stall without errors: one call (or the pass) just took that long
                self.gaps += 1
                log.warning(
                    "Redis (or this controller) stalled: %.1fs between successful round "
                    "trips; silence is not judged for a job's dead_after_s",
                    gap,
                )
        self._down_since = None
        self._last_ok = now
        if uptime_s is not None:
            started = now - uptime_s  # uptime is whole seconds: this is at most 1 s late
            if self._redis_started is None:
                self._redis_started = started
            elif started > self._redis_started + 2.0:  # the whole seconds jitter by < 1 s
                self.restarts += 1
                self._redis_started = started
                log.warning(
                    "Redis restarted %ds ago; heartbeats written before are not judged "
                    "until it has been up for a job's dead_after_s",
                    uptime_s,
                )
            else:
                self._redis_started = max(self._redis_started, started)

    def failed(self, error: BaseException | str) -> None:
        """A round trip failed (connection refused, timeout, loading)."""
        with self._lock:
            self._failed(error)

    def _failed(self, error: BaseException | str) -> None:
        if self._down_since is None:
            self._down_since = self._clock()
            log.warning(
                "Redis unavailable to the controller (%s); no worker is judged dead "
                "while it is away",
                error,
            )

    # -- the question --------------------------------------------------------------------
    @property
    def down(self) -> bool:
        return self._down_since is not None

    def steady(self, window_s: float, gap_s: float | None = None) -> bool:
        """Whether Redis has been available to us for the whole last `window_s`: reachable
        now, up (not restarted) for `window_s`, and no gap longer than `gap_s` (default
        `window_s / 2`) ended within it, nor is open now. Our own start counts as an endless
        gap."""
        with self._lock:
            return self._steady(window_s, window_s / 2 if gap_s is None else gap_s)

    def _steady(self, window_s: float, gap_s: float) -> bool:
        if self._last_ok is None or self._down_since is not None:
            return False
        now = self._clock()
        if now - self._last_ok > gap_s:
            return False  # the gap still open: a round trip in flight, or overdue
        if self._redis_started is not None and now - self._redis_started < window_s:
            return False
        for ended, length in reversed(self._gaps):
            if now - ended >= window_s:
                return True  # older gaps ended before the window
            if length > gap_s:
                return False
        return True
