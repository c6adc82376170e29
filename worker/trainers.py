"""Trainer processes: the warm pool, one process per rank, and bounded stopping.

Each trainer runs in its own process group (start_new_session), so stopping a rank signals
everything it started (services.procs.stop_all).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from services.assignment import FROZEN_PROC_STATES
from services.procs import stop_all
from worker.progress import counters_path, read_counters

log = logging.getLogger("meshkeeper.agent")


class Launcher:
    """Starts trainers, from a pre-forked warm process when one is ready (else cold)."""

    def __init__(self, run_dir: Path, warm: int, env: dict[str, str]):
        self.run_dir, self.warm, self.env = run_dir, warm, env
        self.idle: list[subprocess.Popen] = []
        self._spawned = 0
        self._next_refill = 0.0

    def _spawn(self) -> subprocess.Popen:
        self._spawned += 1
        out = open(self.run_dir / f"warm-{self._spawned}.log", "ab")
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "worker.warm"], stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**self.env, "MESHKEEPER_AGENT_PID": str(os.getpid())})
        finally:
            out.close()

    def refill(self) -> None:
        """Keep `warm` idle processes; a warm process that died is replaced, at most every 5 s."""
        dead = [p for p in self.idle if p.poll() is not None]
        for p in dead:
            log.warning("warm trainer %d exited (%s) before an assignment; see %s/warm-*.log",
                        p.pid, p.returncode, self.run_dir)
            self.idle.remove(p)
        if len(self.idle) >= self.warm or time.monotonic() < self._next_refill:
            return
        if dead:
            self._next_refill = time.monotonic() + 5.0
        while len(self.idle) < self.warm:
            self.idle.append(self._spawn())

    def launch(self, argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        order = json.dumps({"argv": argv, "env": env, "log": str(log_path)}) + "\n"
        while self.idle:
            proc = self.idle.pop(0)
            if proc.poll() is None and _send(proc, order):
                return proc
        proc = self._spawn()  # cold: pays the torch import now
        if not _send(proc, order):
            log.error("a fresh trainer process %d died at once; see %s", proc.pid, self.run_dir)
        return proc

    def close(self) -> None:
        stop_all(self.idle, grace_s=1.0)
        self.idle.clear()


def _send(proc: subprocess.Popen, order: str) -> bool:
    try:
        proc.stdin.write(order.encode())
        proc.stdin.close()
        return True
    except (BrokenPipeError, OSError):
        return False


@dataclass
class RankProcess:
    """One rank's trainer and what it has reported so far (tailed from its metrics file).

    Times are Redis server time (local time + the heartbeat's clock offset), so the
    controller can compare them with its own clock.
    """

    rank: int
    proc: subprocess.Popen
    metrics: Path
    log: Path
    window: int = 20  # steps in the straggler window (the spec's straggler.window_steps)
    started_at: float = 0.0
    state: str = "starting"
    exit_code: int | None = None
    exited_at: float | None = None
    last: dict = field(default_factory=dict)  # latest step record
    ready: dict = field(default_factory=dict)  # the trainer's rendezvous/restore milestones
    first_step_at: float | None = None
    progress_at: float = 0.0
    computes: deque = field(default_factory=deque)
    proc_state: str | None = None
    collectives: tuple[int, int] | None = None  # (entered, left), worker/progress.py
    busy: bool | None = None  # burned most of a core over the last BUSY_WINDOW_S
    memory: "MemoryWatch" = field(default_factory=lambda: MemoryWatch())
    oom: dict | None = None  # set once, when the exit is classified as an OOM kill
    _cpu: deque = field(default_factory=deque)  # (monotonic, cpu seconds) samples
    _offset: int = 0
    _partial: str = ""

    def __post_init__(self) -> None:
        self.progress_at = self.started_at
        self.memory.sample(self.proc.pid)  # the cgroup baseline, before the rank can allocate

    def poll_state(self) -> bool:
        """Re-read the process's scheduler state (R, S, D, T...), CPU use, collective counters
        and memory; True when something the controller judges hangs by changed. A stopped (T)
        or I/O-stuck (D) trainer is what a job-wide hang waits for; R <-> S flips every step
        and is not worth a report, but a process that keeps a core busy while its peers sleep
        in a collective is (the counters change on every step anyway)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            state, cpu = fields[0], (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (OSError, IndexError, ValueError):
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
        self.memory.sample(self.proc.pid)
        return changed

    def classify_exit(self, code: int) -> None:
        """A SIGKILL is an OOM kill when the kernel counted one for the trainer's memory
        cgroup while it ran (or, with no memory cgroup to read, host-wide)."""
        if code == -signal.SIGKILL and self.oom is None:
            self.oom = self.memory.oom_killed()

    def absorb(self, rec: dict, now: float, offset: float) -> None:
        """Take one record of the trainer's metrics file; `now` is server time."""
        self.progress_at = now
        if rec.get("event") in ("started", "rendezvous", "ready"):  # the trainer's milestones
            self.ready.update({k: v + offset for k, v in rec.items() if k.endswith("_at")})
            if "start_step" in rec:
                self.ready["start_step"] = rec["start_step"]
        elif "step" in rec and "event" not in rec:
            self.last, self.state = rec, "running"
            self.first_step_at = self.first_step_at or rec.get("time", now - offset) + offset
            self.computes.append(rec.get("compute_s") or 0.0)
            while len(self.computes) > self.window:
                self.computes.popleft()

    def read_records(self) -> list[dict]:
        """New complete JSON lines since the last call."""
        try:
            with self.metrics.open("r") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return []
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                log.warning("rank %d: unreadable metrics line %r", self.rank, line[:200])
        return out

    def report(self) -> dict:
        if self.exit_code is not None:
            self.classify_exit(self.exit_code)
        r = self.last
        return {"state": self.state, "pid": self.proc.pid, "exit_code": self.exit_code,
                "log": str(self.log), "step": r.get("step", -1) + 1 if r else 0,
                **{k: r.get(k) for k in ("loss", "tokens_per_s", "step_s", "compute_s", "wait_s")},
                "started_at": self.started_at, "exited_at": self.exited_at, **self.ready,
                "first_step_at": self.first_step_at, "progress_at": self.progress_at,
                "compute_avg": sum(self.computes) / len(self.computes) if self.computes else None,
                "compute_min": min(self.computes) if self.computes else None,
                "window_n": len(self.computes), "proc_state": self.proc_state,
                "coll_entered": self.collectives[0] if self.collectives else None,
                "coll_left": self.collectives[1] if self.collectives else None,
                "cpu_busy": self.busy, "peak_rss": self.memory.peak or None, "oom": self.oom}


_CLK_TCK = os.sysconf("SC_CLK_TCK")
BUSY_WINDOW_S = 2.0
_MEMCG_V1 = Path("/sys/fs/cgroup/memory")
_CGROUP_ROOTS_V2 = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _keyed(path: Path, key: str) -> int | None:
    """`key N` lines (memory.events, memory.oom_control, /proc/vmstat)."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return None


@dataclass
class MemoryWatch:
    """A trainer's peak memory and its memory cgroup's OOM-kill count, sampled while it runs
    (after it dies /proc no longer says which cgroup it was in).

    cgroup v2: `memory.events.local` (this group only: a kill in a sibling group must not
    count), `memory.peak`, `memory.max`. cgroup v1: `memory.oom_control` (its `oom_kill` counts
    this group only), `memory.max_usage_in_bytes`, `memory.limit_in_bytes`. Without a memory
    cgroup: /proc/vmstat `oom_kill`, host-wide, the weakest evidence."""

    peak: int = 0  # bytes: VmHWM, and the cgroup's peak when it has a limit
    group: Path | None = None
    v2: bool = False
    kills_at_start: int | None = None  # the group's (or host's) OOM kills when first seen
    limit: int | None = None

    def sample(self, pid: int) -> None:
        hwm = _keyed_kb(Path(f"/proc/{pid}/status"), "VmHWM:")
        if hwm:
            self.peak = max(self.peak, hwm)
        group, v2 = _memory_cgroup(pid)
        if group is not None and group != self.group:  # first seen, or moved into another group
            self.group, self.v2 = group, v2
            self.kills_at_start = self._kills()
            limit = _read_int(group / ("memory.max" if v2 else "memory.limit_in_bytes"))
            self.limit = limit if limit and limit < 1 << 60 else None
        elif self.group is None and self.kills_at_start is None:
            self.kills_at_start = _keyed(Path("/proc/vmstat"), "oom_kill")

    def _kills(self) -> int | None:
        if self.group is None:
            return _keyed(Path("/proc/vmstat"), "oom_kill")
        return _keyed(self.group / ("memory.events.local" if self.v2 else "memory.oom_control"),
                      "oom_kill")

    def oom_killed(self) -> dict | None:
        now = self._kills()
        if now is None or self.kills_at_start is None or now <= self.kills_at_start:
            return None
        if self.group is not None and self.limit:
            group_peak = _read_int(self.group / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes"))
            self.peak = max(self.peak, group_peak or 0)
        return {"peak_rss": self.peak or None, "limit": self.limit,
                "cgroup": str(self.group) if self.group else None,
                "evidence": "memory cgroup oom_kill" if self.group else "host /proc/vmstat oom_kill"}


def _keyed_kb(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_cgroup(pid: int) -> tuple[Path | None, bool]:
    """The directory of `pid`'s memory cgroup and whether it is cgroup v2."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None, False
    for line in lines:  # v1 first: where a v1 memory hierarchy is mounted, it does the limiting
        _, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            d = _MEMCG_V1 / path.lstrip("/")
            if (d / "memory.oom_control").exists():
                return d, False
    for line in lines:
        hid, _, path = line.split(":", 2)
        if hid == "0":
            for root in _CGROUP_ROOTS_V2:
                d = root / path.lstrip("/")
                if (d / "memory.events.local").exists():
                    return d, True
    return None, False
