"""Fixtures of the observability suite: a small stack of its own and the tools that judge it.

The stack is a real redis-server, a real controller and five real agents (a dp2 x pp2 mesh
plus one spare) that, unlike the integration stack's, serve their Prometheus endpoints on
free ports. promtool and Chromium are real binaries; a missing one fails the test with the
command that installs it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from services.procs import free_port, stop_all
from tests.stack import Controller, Proc, RedisServer, TestSecrets, agent_argv, wait_until

ROOT = Path(__file__).resolve().parents[2]
AGENTS = 5
OPEN = ("Pending", "Running", "Recovering")


class ObsStack:
    def __init__(self, work: Path):
        self.work = work
        self.secrets = TestSecrets.create(work / "secrets")
        self.redis = RedisServer(work / "redis", self.secrets)
        self.redis.start()
        self.controller = Controller(self.redis.controller_url, work / "logs", "controller", self.secrets)
        self.client = self.controller.client()
        self.metrics_ports: dict[str, int] = {}
        self.agents = {f"w{i}": self._agent(f"w{i}") for i in range(AGENTS)}

    def _agent(self, wid: str) -> Proc:
        port = self.metrics_ports[wid] = free_port()
        return Proc(f"agent-{wid}", agent_argv(self.controller.url, self.secrets, wid, self.work, port),
                    self.work / "logs")

    def idle(self) -> None:
        """No open job and every agent alive and idle (restarting any a test killed)."""
        for wid, a in self.agents.items():
            if not a.alive():
                self.agents[wid] = self._agent(wid)
        for j in self.client.jobs(limit=1000):
            if j.phase in OPEN:
                self.client.cancel(j.id)

        def all_idle():
            ws = self.client.workers()
            return sum(w.alive and w.state == "idle" and not w.job for w in ws) == AGENTS
        wait_until(all_idle, 120, f"all {AGENTS} agents idle")

    def scrape(self, wid: str) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_ports[wid]}/metrics", timeout=5).text

    def scrape_controller(self) -> str:
        return httpx.get(f"{self.controller.url}/metrics", timeout=5,  # as Prometheus scrapes it
                         headers={"Authorization": f"Bearer {self.secrets.scrape_token}"}).text

    def close(self) -> None:
        self.client.close()
        stop_all([a.p for a in self.agents.values()], 10)
        stop_all([self.controller.proc.p], 5)
        stop_all([self.redis.proc.p], 5)


@pytest.fixture(scope="session")
def obs_stack(tmp_path_factory) -> ObsStack:
    s = ObsStack(tmp_path_factory.mktemp("obs-stack"))
    yield s
    s.close()


@pytest.fixture
def obs(obs_stack: ObsStack) -> ObsStack:
    obs_stack.idle()
    return obs_stack


def _binary(name: str, candidates: list, install: str) -> str:
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return str(c)
    pytest.fail(f"{name} not found; install it with: {install}", pytrace=False)


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary("promtool", [ROOT / ".tools" / "bin" / "promtool", shutil.which("promtool")],
                   "scripts/install-promtool.sh  (extracts Debian's prometheus package into .tools/)")


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """(browser, driver) paths."""
    install = "apt-get install -y chromium chromium-driver"
    return (_binary("chromium", [shutil.which("chromium"), shutil.which("chromium-browser")], install),
            _binary("chromedriver", [shutil.which("chromedriver")], install))
