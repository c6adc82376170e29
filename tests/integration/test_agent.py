"""An agent that only knows the controller's URL and the join token: it joins through the
controller (which registers it and gives it its own Redis user), heartbeats, serves its
metrics, and deregisters when stopped."""

from __future__ import annotations

import httpx

from services.procs import free_port
from tests.integration.conftest import joining_agent, wait_until


def test_agent_joins_through_the_controller_and_deregisters(stack, tmp_path):
    port = free_port()
    agent = joining_agent(
        stack,
        "boot-1",
        tmp_path,
        *("--label", "rack=r7", "--metrics-port", str(port), "--run-dir", str(tmp_path)),
    )
    try:

        def registered():
            return next((w for w in stack.client.workers() if w.id == "boot-1" and w.alive), None)

        w = wait_until(registered, 30, "the agent to join through the controller")
        assert w.state == "idle" and w.labels["rack"] == "r7" and w.labels["host"]
        text = wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/metrics").text, 10, "metrics")
        assert "meshkeeper_agent_heartbeats_total" in text
        agent.stop(10)
        assert agent.p.returncode == 0, agent.tail()
        assert "boot-1" not in [w.id for w in stack.client.workers()]
    finally:
        agent.stop(5)
