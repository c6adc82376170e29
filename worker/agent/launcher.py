"""The agent's trainer launcher: a pool of warm trainer processes, and cold starts.

Each trainer runs in its own process group (start_new_session), so stopping a rank signals
everything it started (services.procs.stop_all). A warm process (worker/agent/warm.py) has
imported torch and the trainer before any assignment; `launch` hands it its rank.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

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
                [sys.executable, "-m", "worker.agent.warm"],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**self.env, "MESHKEEPER_AGENT_PID": str(os.getpid())},
            )
        finally:
            out.close()

    def refill(self) -> None:
        """Keep `warm` idle processes; a warm process that died is replaced, at most every 5 s."""
        dead = [p for p in self.idle if p.poll() is not None]
        for p in dead:
            log.warning(
                "warm trainer %d exited (%s) before an assignment; see %s/warm-*.log",
                p.pid,
                p.returncode,
                self.run_dir,
            )
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
