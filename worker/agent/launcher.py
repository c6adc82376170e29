"""The agent's trainer launcher: trainers forked from a zygote, or started cold.

Each trainer runs in its own process group (its own session), so stopping a rank signals
everything it started (services.procs.stop_all). The zygote (worker/agent/zygote.py) has
imported torch and the trainer once; `launch` has it fork the rank, which the agent then
adopts as its own child (a child subreaper) and watches like any other.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from services.procs import Child, become_subreaper, stop_all
from worker.agent.zygote import TRAINER_MAIN

log = logging.getLogger("meshkeeper.agent")

FORK_TIMEOUT_S = 120.0  # a zygote still importing torch on a loaded host answers late


class Launcher:
    """Starts trainers: forked by the zygote when `warm` (and the kernel lets the agent adopt
    them), else each as a fresh interpreter that imports torch itself."""

    def __init__(self, run_dir: Path, warm: int, env: dict[str, str]):
        self.run_dir, self.env = run_dir, env
        self.warm = warm > 0 and become_subreaper()
        self.zygote: subprocess.Popen | None = None
        self._zygote_ready = False  # it has said so: its imports are done
        self._next_start = 0.0

    def refill(self) -> None:
        """Keep a zygote running; one that died is replaced, at most every 5 s."""
        if not self.warm or (self.zygote is not None and self.zygote.poll() is None):
            return
        if self.zygote is not None:
            log.warning(
                "trainer zygote %d exited (%s); see %s/zygote.log",
                self.zygote.pid,
                self.zygote.returncode,
                self.run_dir,
            )
            self.zygote = None
            self._next_start = time.monotonic() + 5.0
        if time.monotonic() >= self._next_start:
            self.zygote, self._zygote_ready = self._start_zygote(), False

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the zygote has finished its imports, waiting up to `timeout_s` for it. Its
        first stdout line says so; a launch never waits for it (see `launch`)."""
        z = self.zygote
        if z is None:
            return False
        if not self._zygote_ready and select.select([z.stdout], [], [], timeout_s)[0]:
            line = z.stdout.readline()  # b"" once it died; the next refill replaces it
            self._zygote_ready = line.startswith(b'{"ready"')
        return self._zygote_ready

    def _start_zygote(self) -> subprocess.Popen:
        with open(self.run_dir / "zygote.log", "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "worker.agent.zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                start_new_session=True,
                env={**self.env, "MESHKEEPER_AGENT_PID": str(os.getpid())},
            )

    def launch(
        self,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        before: Callable[[int], None] = lambda origin: None,
        main: str = TRAINER_MAIN,
    ) -> Child | subprocess.Popen:
        """Start one rank: `argv` for the trainer's main, `env` on top of the agent's.
        `before(origin)` runs just before the trainer starts, with the pid of the process it
        starts from (the zygote, or the agent for a cold start): the memory cgroup it will
        start in, whose OOM kills must be counted from before it can allocate. `main`: the
        module whose `main(argv)` runs instead of the trainer's (the job's store)."""
        if self.warm:
            self.refill()
            # A zygote still importing torch (a fresh host: seconds) would hold the agent's
            # loop, its beats' interval and its withdrawals; this rank starts cold instead.
            if self.ready():
                before(self.zygote.pid)
                pid = self._fork(argv, env, log_path, main)
                if pid:
                    return Child(pid)
        before(os.getpid())
        cold = ["worker.agent.zygote", "--cold"] if main == TRAINER_MAIN else [main]
        with open(log_path, "ab") as out:  # cold: pays the torch import now
            return subprocess.Popen(
                [sys.executable, "-m", *cold, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**self.env, **env, "MESHKEEPER_AGENT_PID": str(os.getpid())},
            )

    def _fork(self, argv: list[str], env: dict[str, str], log_path: Path, main: str) -> int | None:
        """The forked trainer's pid, or None when the zygote cannot answer (then it is
        stopped; the next refill starts another)."""
        z = self.zygote
        order = {"argv": argv, "env": env, "log": str(log_path), "main": main}
        order = json.dumps(order) + "\n"
        try:
            z.stdin.write(order.encode())
            z.stdin.flush()
            ready, _, _ = select.select([z.stdout], [], [], FORK_TIMEOUT_S)
            line = z.stdout.readline() if ready else b""
            return int(json.loads(line)["pid"])
        except (OSError, ValueError, KeyError) as e:
            log.error(
                "trainer zygote %d did not fork (%s); see %s/zygote.log", z.pid, e, self.run_dir
            )
            stop_all([z], grace_s=1.0)
            return None

    def close(self) -> None:
        if self.zygote is not None:
            stop_all([self.zygote], grace_s=1.0)
            self.zygote = None
