"""The agent's Prometheus endpoint (DESIGN.md section 8 naming).

Two sources:
- records the trainers write (step timings, checkpoint and restore events), observed as the
  agent relays them: histograms and counters labelled by `job_id` only (no per-rank labels
  on histograms); a job's children are removed once this worker stops serving it;
- what the agent holds at scrape time: each running rank's latest step split, memory and
  MFU as per-rank gauges (what the dashboard's per-rank heat map draws), heartbeats.

The endpoint advertises itself in Redis (services/discovery.py) so Prometheus finds every
worker through the controller's HTTP service discovery. One registry per agent.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services import discovery
from services.spec import ModelSpec
from worker import mfu

if TYPE_CHECKING:
    from worker.agent import Agent, Run

log = logging.getLogger("meshkeeper.agent")
STEP_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
SAVE_BUCKETS = (.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _num(rec: dict, key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) and v >= 0 else None


class AgentMetrics:
    def __init__(self, peak_flops: float | None = None, devices: int = 1):
        self.peak_flops = peak_flops or mfu.default_peak_flops(devices)
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.step_seconds = Histogram(
            "meshkeeper_train_step_duration_seconds", "Training step wall time, one observation per rank step",
            ["job_id"], registry=reg, buckets=STEP_BUCKETS)
        self.compute_seconds = Counter("meshkeeper_train_compute_seconds",
                                       "Ranks' own compute time", ["job_id"], registry=reg)
        self.wait_seconds = Counter("meshkeeper_train_collective_wait_seconds",
                                    "Ranks' time waiting in collectives", ["job_id"], registry=reg)
        self.save_blocking = Histogram(
            "meshkeeper_checkpoint_save_blocking_seconds", "Training time a checkpoint save blocked, per rank",
            ["job_id"], registry=reg, buckets=SAVE_BUCKETS)
        self.save_background = Histogram(
            "meshkeeper_checkpoint_save_background_seconds",
            "Time a checkpoint save ran behind training until committed, per rank",
            ["job_id"], registry=reg, buckets=SAVE_BUCKETS)
        self.save_failures = Counter("meshkeeper_checkpoint_save_failures",
                                     "Checkpoint saves that failed, per rank", ["job_id"], registry=reg)
        self.restore_seconds = Histogram(
            "meshkeeper_checkpoint_restore_seconds", "Time a rank took to restore a checkpoint",
            ["job_id"], registry=reg, buckets=SAVE_BUCKETS)
        self._labelled = (self.step_seconds, self.compute_seconds, self.wait_seconds, self.save_blocking,
                          self.save_background, self.save_failures, self.restore_seconds)
        ProcessCollector(registry=reg)  # the agent's own CPU and memory
        self.agent: "Agent | None" = None
        self._job: str | None = None
        self._lock = threading.Lock()

    # -- records the agent relays ------------------------------------------------------------
    def observe(self, rec: dict) -> None:
        """One record of a trainer's metrics file (a step or an event) of the job being served."""
        job = self.follow(self.agent.run if self.agent else None)
        if job is None:
            return
        event = rec.get("event")
        if event is None and "step" in rec:
            for metric, key in ((self.step_seconds.labels(job).observe, "step_s"),
                                (self.compute_seconds.labels(job).inc, "compute_s"),
                                (self.wait_seconds.labels(job).inc, "wait_s")):
                if (v := _num(rec, key)) is not None:
                    metric(v)
        elif event == "checkpoint":
            blocking, total = _num(rec, "blocking_s"), _num(rec, "total_s")
            if blocking is not None:
                self.save_blocking.labels(job).observe(blocking)
                if total is not None:
                    self.save_background.labels(job).observe(max(0.0, total - blocking))
        elif event == "checkpoint_failed":
            self.save_failures.labels(job).inc()
        elif event == "restored" and (v := _num(rec, "restore_s")) is not None:
            self.restore_seconds.labels(job).observe(v)

    # The agent's call site today passes step records only; events need it to call observe().

    def follow(self, run: "Run | None") -> str | None:
        """The job of the agent's current run; children of a job it no longer serves are removed."""
        job = run.job if run else None
        with self._lock:
            if self._job is not None and self._job != job:
                for m in self._labelled:
                    try:
                        m.remove(self._job)
                    except KeyError:  # never observed for that job
                        pass
            self._job = job
        return job

    # -- wiring ---------------------------------------------------------------------------
    def watch(self, agent: "Agent") -> None:
        self.agent = agent
        self.registry.register(_AgentCollector(self))

    def serve(self, host: str, port: int) -> None:
        try:
            start_http_server(port, host, registry=self.registry)
        except OSError as e:  # a busy port must not keep the agent from working
            log.warning("metrics endpoint %s:%d not started: %s", host, port, e)
            return
        if self.agent is not None:
            target = discovery.target_for(host, port, self.agent.cfg.address)
            threading.Thread(target=self._advertise, args=(target,), name="metrics-advertise",
                             daemon=True).start()

    def _advertise(self, target: str) -> None:
        """Keep this endpoint in Redis for the controller's service discovery."""
        agent, down = self.agent, False
        while True:  # a daemon thread: it ends with the agent's process
            try:
                discovery.advertise(agent.store, agent.cfg.wid, target)
                down = False
            except redis.RedisError as e:
                if not down:
                    log.warning("cannot advertise the metrics endpoint %s (%s); retrying", target, e)
                down = True
            time.sleep(discovery.REFRESH_S if not down else 1.0)


class _AgentCollector:
    """Scrape-time state of the agent and its running ranks."""

    def __init__(self, metrics: AgentMetrics):
        self.m = metrics
        self._specs: dict[Path, tuple[float, int] | None] = {}  # spec file -> (FLOPs/token, world)

    def describe(self):
        return []

    def collect(self):
        agent = self.m.agent
        hb = agent.heartbeat
        yield CounterMetricFamily("meshkeeper_agent_heartbeats", "Heartbeats written", value=hb.beats)
        yield CounterMetricFamily("meshkeeper_agent_heartbeat_failures",
                                  "Heartbeats that could not reach Redis", value=hb.failures)
        yield GaugeMetricFamily("meshkeeper_agent_peak_flops", "Configured peak FLOP/s of one rank "
                                "(the MFU denominator)", value=self.m.peak_flops)
        run = agent.run  # one read: the agent's loop may replace it meanwhile
        job = self.m.follow(run)
        live = [p for p in run.ranks.values() if p.exit_code is None] if run else []
        yield GaugeMetricFamily("meshkeeper_agent_trainers", "Trainer processes running", value=len(live))
        labels = ["job_id", "rank"]
        gauges = {key: GaugeMetricFamily(name, doc, labels=labels) for key, name, doc in (
            ("step_s", "meshkeeper_rank_step_seconds", "Latest step wall time of each rank"),
            ("compute_s", "meshkeeper_rank_compute_seconds", "Latest step's own compute time of each rank"),
            ("wait_s", "meshkeeper_rank_collective_wait_seconds",
             "Latest step's time in collectives of each rank"))}
        rss = GaugeMetricFamily("meshkeeper_rank_resident_memory_bytes",
                                "Resident memory of each rank's trainer process", labels=labels)
        util = GaugeMetricFamily("meshkeeper_train_mfu_ratio", "Model FLOPs utilisation: model FLOP/s "
                                 "of a rank over its configured peak (latest step)", labels=labels)
        seen: set[Path] = set()
        for p in live:
            lv = [job, str(p.rank)]
            for key, g in gauges.items():
                if (v := _num(p.last, key)) is not None:
                    g.add_metric(lv, v)
            if (mem := _rss(p.proc.pid)) is not None:
                rss.add_metric(lv, mem)
            seen.add(spec_path := p.metrics.parent / "spec.json")
            model = self._model(spec_path)
            if model and (tps := _num(p.last, "tokens_per_s")):
                util.add_metric(lv, mfu.mfu(model[0], tps, model[1], self.m.peak_flops))
        self._specs = {k: v for k, v in self._specs.items() if k in seen}  # only live runs' specs
        yield from gauges.values()
        yield rss
        yield util

    def _model(self, spec_path: Path) -> tuple[float, int] | None:
        """FLOPs per token and world size of the spec a rank runs (the agent writes it beside
        the rank's metrics file; after a shrink it is the shrunk mesh's)."""
        if spec_path not in self._specs:
            try:
                spec = json.loads(spec_path.read_text())
                p = spec["parallel"]
                self._specs[spec_path] = (mfu.flops_per_token(ModelSpec(**spec["model"])),
                                          p["dp"] * p["pp"] * p["tp"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("no MFU for %s: %s", spec_path, e)
                self._specs[spec_path] = None
        return self._specs[spec_path]


def _rss(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None
