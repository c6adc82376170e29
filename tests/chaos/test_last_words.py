"""A rank's last lines outlive its agent (issue 46, "Logs"): an agent stopped with SIGTERM, as
Kubernetes stops a pod it replaces, ships what its trainers wrote since its last tick to the
job's log stream before it exits, so `meshkeeper logs` still shows it once the pod and its run
dir are gone. And `kill -USR1` on a trainer writes every thread's stack into its log.

On the shared stack: the agent is SIGSTOPped first, so nothing it does on its own ticks can
ship the lines written meanwhile; only its stop can."""

from __future__ import annotations

import os
import signal

import pytest

from tests.chaos.chaos import at_step, mesh_spec, metrics_path, start, wait_record
from tests.stack import wait_until

pytestmark = pytest.mark.slow


def test_a_stopped_agent_ships_its_trainers_last_lines(stack):
    spec = {**mesh_spec("last-words", steps=400, parallel={"dp": 1}), "chaos": {"min_step_s": 0.25}}
    w, j = start(stack, spec)
    rank = j.mesh.ranks[0]
    agent = stack.agents[rank.worker]
    metrics = metrics_path(stack, j, 0)
    log = metrics.parent / "rank0.log"
    try:
        wait_record(metrics, at_step(2), 120, "rank 0 at step 2")
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            os.kill(rank.pid, signal.SIGUSR1)  # the stacks go to the trainer's own log
            wait_until(lambda: "most recent call first" in log.read_text(), 30, "the stack dump")
            os.kill(agent.pid, signal.SIGTERM)  # held until it runs again
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        assert agent.p.wait(60) == 0
        lines = [x.line for x in stack.client.logs(j.id, rank=0, limit=1000)]
        assert any("most recent call first" in x for x in lines), lines[-20:]
        assert any("worker/trainer/" in x for x in lines), lines[-20:]
    finally:
        stack.client.cancel(j.id)
        stack.restart_agent(rank.worker)
        wait_until(
            lambda: any(x.id == rank.worker and x.alive for x in stack.client.workers()),
            60,
            f"{rank.worker} back",
        )
        w.finish()
