"""The agent's Prometheus endpoint (DESIGN.md section 8 naming; no per-rank labels).

Step timings come from the trainers' metrics lines as the agent relays them; heartbeat
counts from the heartbeat thread. One registry per agent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from worker.agent import Agent

log = logging.getLogger("meshkeeper.agent")


class AgentMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.step_seconds = Histogram(
            "meshkeeper_train_step_duration_seconds", "Training step wall time, per rank step",
            registry=self.registry, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.compute_seconds = Counter("meshkeeper_train_compute_seconds",
                                       "Ranks' own compute time", registry=self.registry)
        self.wait_seconds = Counter("meshkeeper_train_collective_wait_seconds",
                                    "Ranks' time waiting in collectives", registry=self.registry)

    def observe_step(self, rec: dict) -> None:
        for metric, key in ((self.step_seconds.observe, "step_s"), (self.compute_seconds.inc, "compute_s"),
                            (self.wait_seconds.inc, "wait_s")):
            if isinstance(rec.get(key), (int, float)) and rec[key] >= 0:
                metric(rec[key])

    def watch(self, agent: "Agent") -> None:
        self.registry.register(_AgentCollector(agent))

    def serve(self, host: str, port: int) -> None:
        try:
            start_http_server(port, host, registry=self.registry)
        except OSError as e:  # a busy port must not keep the agent from working
            log.warning("metrics endpoint %s:%d not started: %s", host, port, e)


class _AgentCollector:
    def __init__(self, agent: "Agent"):
        self.agent = agent

    def describe(self):
        return []

    def collect(self):
        hb = self.agent.heartbeat
        yield CounterMetricFamily("meshkeeper_agent_heartbeats", "Heartbeats written", value=hb.beats)
        yield CounterMetricFamily("meshkeeper_agent_heartbeat_failures",
                                  "Heartbeats that could not reach Redis", value=hb.failures)
        run = self.agent.run
        live = sum(1 for p in run.ranks.values() if p.exit_code is None) if run else 0
        yield GaugeMetricFamily("meshkeeper_agent_trainers", "Trainer processes running", value=live)
