"""`meshkeeper up` as the user runs it (cli/local_stack.py), seen through the attributes the
chaos helpers use (`work`, `client`, `job_dir`, `logs`): it lays out its run dir like the test
stack, so tests/chaos/chaos.py's helpers read its jobs' records as they read the shared
stack's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from cli.local_stack import wait_ready
from services.client import Client
from services.procs import descendants
from tests.stack import ENV, ROOT, wait_until


class UpStack:
    def __init__(self, run: Path, port: int, workers: int):
        self.work, self.url = run, f"http://127.0.0.1:{port}"
        self.log = run.parent / "up.log"
        # --allow-chaos: the silent-data-corruption tests submit bit flips with the admin token
        self.argv = [sys.executable, "-m", "cli", "up", "--workers", str(workers), "--warm", "1"]
        self.argv += ["--allow-chaos", "--port", str(port), "--run-dir", str(run)]
        self._launch()

    def _launch(self) -> None:
        token = self.work / "secrets" / "api-token"  # the admin token `up` writes first
        token.unlink(missing_ok=True)  # a restart writes a fresh one
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env={k: v for k, v in ENV.items() if k != "REDIS_URL"},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(
            lambda: token.exists() and token.read_text().strip(), 30, f"{token} (see {self.log})"
        )
        self.token = token.read_text().strip()
        self.scrape_token_file = self.work / "secrets" / "scrape-token"
        self.client = Client(self.url, self.token)

    def restart(self, workers: int, stop_s: float = 200) -> None:
        """Stop `up` as a user does (SIGTERM: it suspends the open jobs first) and start it
        again on the same run dir and port, ready with `workers` agents."""
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(stop_s)
        self._launch()
        self.wait_ready(workers)

    def wait_ready(self, workers: int, timeout: float = 120) -> None:
        """The controller ready with `workers` live agents; fails at once if `up` exits."""

        def up_alive() -> None:
            if self.proc.poll() is not None:
                pytest.fail(f"meshkeeper up exited:\n{self.logs()}")

        assert wait_ready(self.url, workers, timeout, up_alive, self.token), self.logs()

    def job_dir(self, wid: str, job: str, generation: int = 1) -> Path:
        return self.work / "workers" / wid / "jobs" / job / f"g{generation}"

    def _child(self, match) -> int | None:
        for pid in descendants(self.proc.pid):
            try:
                if match(psutil.Process(pid)):
                    return pid
            except psutil.Error:
                pass
        return None

    def redis_pid(self) -> int | None:
        return self._child(lambda p: p.name() == "redis-server")

    def agent_pid(self, wid: str) -> int | None:
        """The pid of agent `wid` (`python -m worker ... --id wid`)."""

        def is_agent(p: psutil.Process) -> bool:
            argv = p.cmdline()
            return argv[1:3] == ["-m", "worker"] and argv[argv.index("--id") + 1] == wid

        return self._child(is_agent)

    def logs(self) -> str:
        out = [f"--- up\n{self.log.read_text(errors='replace')[-1500:]}"]
        for name in ("controller", "redis"):
            f = self.work / "logs" / f"{name}.log"
            if f.exists():
                out.append(f"--- {name}\n{f.read_text(errors='replace')[-1500:]}")
        return "\n".join(out)

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)  # `up` stops agents, controller, Redis in order
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.wait()
