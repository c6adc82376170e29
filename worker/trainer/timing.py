"""A rank's own compute time, excluding time blocked in collectives.

In synchronous training every rank's step takes the same wall time: the fast ones wait
for the slowest inside collectives. What differs is how long a rank *wanted* the CPU:
time running plus time runnable but queued (CPU contention). Linux reports both per
thread in /proc/thread-self/schedstat; time blocked on a socket (gloo waiting for a
peer) is in neither. Where schedstat is missing, thread CPU time is the fallback.
"""

from __future__ import annotations

import time
from pathlib import Path

_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def _demand_s() -> float:
    try:
        on_cpu_ns, queued_ns, _ = _SCHEDSTAT.read_text().split()
        return (int(on_cpu_ns) + int(queued_ns)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


class CpuClock:
    def __init__(self) -> None:
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = _demand_s()

    def stop(self) -> float:
        return _demand_s() - self._t0
