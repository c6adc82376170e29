"""Collective progress: how many of its step's collective phases a rank entered and left.

When a synchronous job hangs, every rank's step is frozen, so step progress alone cannot say
which rank the others wait for. These two counters can: the ranks waiting inside a collective
have entered one more than the rank they wait on (docs/architecture.md, "Failure handling":
a rank hangs while its worker beats). Each step has the same phases on every rank, whatever
the layout:
    1. forward/backward (FSDP all-gathers and reduce-scatters, TP and pipeline comms)
    2. the global gradient-norm all-reduce
    3. the loss all-reduce
so the n-th phase is the same sync point everywhere.

The counters live in a 16-byte file the trainer maps into memory (`<metrics file>.collectives`,
next to the rank's metrics file) and the agent reads. Writing is two stores into shared pages:
no thread, no lock, no syscall. It keeps working however the trainer is stuck: blocked in C++
inside gloo, spinning in Python, or stopped; what the agent reads is the last value written.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
from contextlib import contextmanager
from pathlib import Path

_FMT = "<qq"  # entered, left
_SIZE = struct.calcsize(_FMT)
# Test-only fault injection (tests/chaos/test_blame.py): honoured only when the agent that
# started the trainer has this variable set to "1". Never set in production.
CHAOS_ENV = "MESHKEEPER_CHAOS_HOOKS"


def counters_path(metrics: str | Path) -> Path:
    """Where a rank's counters live, from its metrics file (the agent knows that path too)."""
    return Path(str(metrics) + ".collectives")


def read_counters(path: Path) -> tuple[int, int] | None:
    """(entered, left), or None when the trainer has not created the file yet."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _SIZE:
        return None
    entered, left = struct.unpack_from(_FMT, data)
    return entered, left


class Collectives:
    """The trainer's side. `phase()` wraps one collective phase of a step."""

    def __init__(self, path: Path | None):
        self.entered = self.left = 0
        self._mm: mmap.mmap | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, _SIZE)
                self._mm = mmap.mmap(fd, _SIZE)
            finally:
                os.close(fd)
            self._store()
        self._spin_requested = False
        if path is not None and os.environ.get(CHAOS_ENV) == "1":
            signal.signal(signal.SIGUSR2, self._request_spin)

    def _store(self) -> None:
        if self._mm is not None:
            struct.pack_into(_FMT, self._mm, 0, self.entered, self.left)

    @contextmanager
    def phase(self):
        self.entered += 1
        self._store()
        yield
        self.left += 1  # not on an exception: the rank never completed this collective
        self._store()

    def step_boundary(self) -> None:
        """Between two steps, outside any collective (where data loading runs). The chaos hook
        spins here: a rank stuck in a pure-Python busy loop (state R) that never enters its next
        collective, as a data loader caught in an endless loop would."""
        if self._spin_requested:
            print(
                f"[meshkeeper] chaos: SIGUSR2 received; spinning after collective {self.left}",
                flush=True,
            )
            while True:
                pass

    def _request_spin(self, signum, frame) -> None:
        self._spin_requested = True
