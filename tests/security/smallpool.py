"""A small private stack for the admission and data-root tests: a real redis-server, one real
controller process started with the flags under test, and a few real agents joined with the
join token. Agents keep no warm trainer (`--warm 0`): most tests here never start one, and the
shared 8-agent stack cannot take other controller flags."""

from __future__ import annotations

from pathlib import Path

from services.client import Client
from services.procs import stop_all
from tests.stack import Controller, Proc, RedisServer, TestSecrets, agent_argv, wait_until


class SmallPool:
    def __init__(
        self, work: Path, agents: int, controller_flags: list[str] = (), agent_flags: list[str] = ()
    ):
        self.work = work
        self.secrets = TestSecrets.create(work / "secrets")
        self.redis = RedisServer(work / "redis", self.secrets)
        self.redis.work.mkdir(parents=True)
        self.redis.start()
        self.controller = Controller(
            self.redis,
            work / "logs",
            "controller",
            self.secrets,
            extra=list(controller_flags),
        )
        self.agents = [
            Proc(
                f"agent-p{i}",
                [
                    *agent_argv(self.controller.url, self.secrets, f"p{i}", work),
                    "--warm",
                    "0",
                    *agent_flags,
                ],
                work / "logs",
            )
            for i in range(agents)
        ]
        self.client = self.client_as(self.secrets.admin_token)
        wait_until(
            lambda: sum(w.alive for w in self.client.workers()) == agents,
            60,
            f"{agents} agents to join",
        )

    def client_as(self, token: str) -> Client:
        return Client(self.controller.url, token, timeout=10)

    def logs(self) -> str:
        """The controller's log tail (what the chaos helpers print on a failure)."""
        return f"--- controller\n{self.controller.proc.tail(3000)}"

    def close(self) -> None:
        self.client.close()
        stop_all([a.p for a in self.agents], 10)
        stop_all([self.controller.proc.p, self.redis.proc.p], 5)
