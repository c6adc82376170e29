"""Trainer processes: the warm pool, one process per rank, and bounded stopping.

Each trainer runs in its own process group (start_new_session), so stopping a rank signals
everything it started (services.procs.stop_all).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from services.assignment import FROZEN_PROC_STATES
from services.procs import stop_all

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
    _offset: int = 0
    _partial: str = ""

    def __post_init__(self) -> None:
        self.progress_at = self.started_at

    def poll_state(self) -> bool:
        """Re-read the process's scheduler state (R, S, D, T...); True when it became or
        stopped being frozen. A stopped (T) or I/O-stuck (D) trainer is what a job-wide
        hang waits for; R <-> S flips every step and is not worth a report."""
        try:
            state = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = None
        changed = (state in FROZEN_PROC_STATES) != (self.proc_state in FROZEN_PROC_STATES)
        self.proc_state = state
        return changed

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
        r = self.last
        return {"state": self.state, "pid": self.proc.pid, "exit_code": self.exit_code,
                "log": str(self.log), "step": r.get("step", -1) + 1 if r else 0,
                **{k: r.get(k) for k in ("loss", "tokens_per_s", "step_s", "compute_s", "wait_s")},
                "started_at": self.started_at, "exited_at": self.exited_at, **self.ready,
                "first_step_at": self.first_step_at, "progress_at": self.progress_at,
                "compute_avg": sum(self.computes) / len(self.computes) if self.computes else None,
                "compute_min": min(self.computes) if self.computes else None,
                "window_n": len(self.computes), "proc_state": self.proc_state}
