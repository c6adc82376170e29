"""A rank's own compute time in a step, excluding time blocked in collectives.

In synchronous training every rank's step takes the same wall time: the fast ones wait for the
slowest inside collectives. What differs is how long a rank's own work took; that is what
straggler detection compares (docs/architecture.md, "Records": `compute_s`, `wait_s`).

- CPU (`CpuClock`): how long the rank *wanted* the CPU: time running plus time runnable but
  queued (CPU contention). Linux reports both per thread in /proc/thread-self/schedstat; time
  blocked on a socket (gloo waiting for a peer) is in neither. Where schedstat is missing,
  thread CPU time is the fallback.
- GPU (`CudaClock`): the host's CPU time means nothing once kernels run asynchronously, so
  CUDA events on the step's stream time it on the device: the GPU time from `start()` to
  `stop()`, less the sections the step marks `waiting()` (a collective the stream waits for,
  peers included). Communication that FSDP overlaps with compute on its own streams is not
  in the step stream's time; only where the stream waits on it outside a `waiting()` section
  does the wait count as compute.

Both keep one interface (worker/trainer/step.py): `start()`, `waiting()`, `stop()` -> seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch

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

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to mark: time blocked in a collective is not CPU demand."""
        return contextlib.nullcontext()

    def stop(self) -> float:
        return _demand_s() - self._t0


class CudaClock:
    def __init__(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._stop = torch.cuda.Event(enable_timing=True)
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        self._waits.clear()
        self._start.record()  # on the current stream of the current device: the step's

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._waits.append((begin, end))

    def stop(self) -> float:
        self._stop.record()
        # The one host sync this clock adds: at the end of the step, after the optimizer's
        # kernels were queued; every earlier event has completed once this one has.
        self._stop.synchronize()
        total_ms = self._start.elapsed_time(self._stop)
        waited_ms = sum(b.elapsed_time(e) for b, e in self._waits)
        return max(0.0, total_ms - waited_ms) / 1e3


def step_clock(device: torch.device) -> CpuClock | CudaClock:
    """The clock for a rank on `device`."""
    return CudaClock() if device.type == "cuda" else CpuClock()
