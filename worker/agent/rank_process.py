"""One rank's trainer process as its agent supervises it: what the trainer reported in its
metrics file, its scheduler state and CPU use (psutil), its collective counters and memory."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from services.assignment import FROZEN_PROC_STATES
from services.records import RankReport
from worker.agent.memory_watch import MemoryWatch
from worker.agent.metrics_tail import MetricsTail, TrainerLine
from worker.agent.rank_progress import RankProgress
from worker.progress import counters_path, read_counters

BUSY_WINDOW_S = 2.0
ERROR_TAIL_BYTES = 2048  # a traceback's last frames and its exception line
LOG_ECHO_BYTES = 1 << 18  # of a rank's log echoed per agent tick: a chatty rank cannot stall it
# Reports keep the kernel's one-letter states (R, S, D, T...: services/assignment.py,
# controller/health.py); psutil names them.
PROC_STATES = {
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X",
    psutil.STATUS_WAKING: "W",
    psutil.STATUS_IDLE: "I",
    psutil.STATUS_PARKED: "P",
    "wake-kill": "K",  # (psutil has no constant for it)
}


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen
    metrics: Path  # the trainer's metrics file (its collective counters lie beside it)
    log: Path
    progress: RankProgress
    exit_code: int | None = None
    exited_at: float | None = None  # server time the agent saw it exit (not when it stopped it)
    proc_state: str | None = None
    collectives: tuple[int, int] | None = None  # (entered, left), worker/progress.py
    busy: bool | None = None  # burned most of a core over the last BUSY_WINDOW_S
    memory: MemoryWatch = field(default_factory=MemoryWatch)
    oom: dict[str, Any] | None = None  # set once, when the exit is classified as an OOM kill
    device: dict[str, Any] | None = None  # NVML's view of its GPU after a device error
    flight: dict[str, Any] | None = None  # its flight recorder's dump after a watchdog abort
    error: str | None = None  # a failed trainer's last words: the tail of its log
    # how it was started, for a fresh start when a kept process does not take its order
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # monotonic time its agent handed this generation's order to a kept process (worker/
    # trainer/handoff.py); None once the trainer began it (its metrics file exists)
    handed_at: float | None = None
    handed_from: Path | None = None  # the log the kept process writes until it takes the order
    _echoed: int = 0  # bytes of the log already echoed (`new_log_lines`)
    _cpu: deque[tuple[float, float]] = field(default_factory=deque)  # (monotonic, cpu seconds)

    def __post_init__(self) -> None:
        self.tail = MetricsTail(self.metrics, self.rank)
        # Not reaped before the agent polls it, so the pid cannot be reused meanwhile.
        self.process = psutil.Process(self.proc.pid)
        # Readable once the trainer has exited: the agent's wait wakes on it (`exit_fd`).
        # Without one (a kernel before 5.3) the agent sees the exit at its next tick.
        try:
            self._pidfd: int | None = os.pidfd_open(self.proc.pid)
        except OSError:
            self._pidfd = None
        self.memory.sample(self.process)  # the cgroup baseline, before the rank can allocate

    def exit_fd(self) -> int | None:
        """A descriptor that turns readable when the trainer exits (its pidfd); None once
        its end was recorded."""
        return self._pidfd

    def keepable(self) -> bool:
        """Whether this process may take the next generation in place: running, said it can,
        not stopped or stuck in the kernel, and in no memory group of its own (that group
        was made for one generation's rank)."""
        return (
            self.exit_code is None
            and self.progress.restartable
            and self.proc_state not in FROZEN_PROC_STATES
            and not self.memory.pinned
        )

    def forget(self) -> None:
        """Hand the process over to the next generation's record: this one stops watching."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def read(self) -> list[TrainerLine]:
        """The trainer's new metrics lines."""
        return self.tail.read()

    def new_log_lines(self, limit: int = LOG_ECHO_BYTES) -> list[str]:
        """Whole lines the trainer wrote to its log since the last call, at most `limit`
        bytes of them a call (a partial last line waits for its newline)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._echoed)
                data = f.read(limit)
        except OSError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        if not whole and len(data) == limit:  # one line longer than the limit: cut it
            whole = data
        self._echoed += len(whole)
        return whole.decode(errors="replace").splitlines()

    def poll_state(self) -> bool:
        """Re-read the process's scheduler state (R, S, D, T...), CPU use, collective counters
        and memory; True when something the controller judges hangs by changed. A stopped (T)
        or I/O-stuck (D) trainer is what a job-wide hang waits for; R <-> S flips every step
        and is not worth a report, but a process that keeps a core busy while its peers sleep
        in a collective is (the counters change on every step anyway)."""
        try:
            with self.process.oneshot():
                state = PROC_STATES.get(self.process.status(), "?")
                times = self.process.cpu_times()
            cpu: float | None = times.user + times.system
        except psutil.Error:
            state, cpu = None, None
        changed = (state in FROZEN_PROC_STATES) != (self.proc_state in FROZEN_PROC_STATES)
        self.proc_state = state
        if cpu is not None:
            t = time.monotonic()
            self._cpu.append((t, cpu))
            while len(self._cpu) > 2 and t - self._cpu[1][0] >= BUSY_WINDOW_S:
                self._cpu.popleft()
            (t0, c0) = self._cpu[0]
            if t - t0 >= BUSY_WINDOW_S / 2:
                busy = (cpu - c0) / (t - t0) >= 0.5
                changed |= busy != self.busy
                self.busy = busy
        counts = read_counters(counters_path(self.metrics))
        changed |= counts != self.collectives
        self.collectives = counts
        self.memory.sample(self.process)
        return changed

    def ended(self, code: int | None, state: str, at: float | None = None) -> None:
        """The trainer exited (`at`: when the agent saw it) or was stopped (no `at`)."""
        self.exit_code, self.exited_at, self.progress.state = code, at, state
        if state == "failed":
            self.error = log_tail(self.log)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def report(self) -> RankReport:
        """This rank's entry in `worker:{wid}:progress` (docs/architecture.md, "Records")."""
        # A SIGKILL is an OOM kill when the kernel counted one for the trainer's memory cgroup
        # while it ran (or, with no memory cgroup to read, host-wide). Asked at each report
        # until it says so, so a kill the kernel counts late still shows.
        if self.exit_code == -signal.SIGKILL and self.oom is None:
            self.oom = self.memory.oom_killed()
        c = self.collectives
        return RankReport(
            **self.progress.fields(),
            pid=self.proc.pid,
            exit_code=self.exit_code,
            log=str(self.log),
            error=self.error,
            exited_at=self.exited_at,
            proc_state=self.proc_state,
            coll_entered=c[0] if c else None,
            coll_left=c[1] if c else None,
            cpu_busy=self.busy,
            peak_rss=self.memory.peak or None,
            oom=self.oom,
            device=self.device,
            flight=self.flight,
        )


def log_tail(path: Path, limit: int = ERROR_TAIL_BYTES) -> str | None:
    """The last whole lines of a trainer's log within `limit` bytes (its traceback, when it
    died of one), so the job's status and events say why without a login on the worker."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return None
    if size > limit and b"\n" in data:  # drop the cut first line
        data = data.split(b"\n", 1)[1]
    return data.decode(errors="replace").strip() or None
