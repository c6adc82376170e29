"""Prometheus metrics of one controller (names: docs/architecture.md, "Observability").

Gauges about jobs, workers and ranks are read from Redis at scrape time (the controller keeps
no state of its own; see metrics_jobs.py); recovery histograms are fed from the jobs'
`recoveries` records (metrics_recovery.py); request and reconcile timings are observed in
process. One registry per controller, no process-global registry. What the metrics read of
the controller is handed in (`Scraped`): they never reach back into controller/service.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controller.conditions import PHASES, TERMINAL
from controller.jobs import Job
from controller.metrics_jobs import JobFamilies
from controller.metrics_recovery import RecoveryFeed
from services.store import Store


@dataclass(frozen=True)
class Scraped:
    """What a scrape reads: the controller's store, its id, whether it leads now, and how
    recent a heartbeat must be for a worker to count as alive."""

    store: Store
    controller_id: str
    leading: Callable[[], bool]
    worker_alive_s: float


class ControllerMetrics:
    def __init__(self, src: Scraped):
        self.registry = CollectorRegistry(auto_describe=True)
        self.pass_seconds = Histogram(
            "meshkeeper_scheduler_pass_duration_seconds",
            "One reconcile pass of the lease holder",
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        # the pass thread's own CPU (time.thread_time): what a pass costs, apart from the
        # time it waited for Redis or for the GIL (REST requests share the process)
        self.pass_cpu_seconds = Histogram(
            "meshkeeper_scheduler_pass_cpu_seconds",
            "CPU time of one reconcile pass of the lease holder",
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.http_seconds = Histogram(
            "meshkeeper_http_request_duration_seconds",
            "REST request latency",
            ["method", "route"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.registry.register(_RedisCollector(src, RecoveryFeed()))


class _RedisCollector:
    def __init__(self, src: Scraped, recoveries: RecoveryFeed):
        self.src, self.recoveries = src, recoveries

    def describe(self):
        return []

    def collect(self):
        leader = GaugeMetricFamily(
            "meshkeeper_controller_leader",
            "1 while this replica holds the lease",
            labels=["controller"],
        )
        leader.add_metric([self.src.controller_id], 1.0 if self.src.leading() else 0.0)
        yield leader
        errors = CounterMetricFamily(
            "meshkeeper_state_errors",
            "Malformed state in Redis that this controller met and went on past: a worker's "
            "registration (the worker is not placed), a job skipped in a pass",
            labels=["kind"],
        )
        for kind in dict.fromkeys(("registration", "job", *self.src.store.state_errors)):
            errors.add_metric([kind], self.src.store.state_errors[kind])
        yield errors
        try:
            store = self.src.store
            now, seen = store.now(), store.workers_seen()
            alive = {w for w, t in seen.items() if t >= now - self.src.worker_alive_s}
            families = list(self._workers(now, seen, alive)) + list(self._jobs(now, alive))
        except redis.RedisError:
            families = []  # Redis down: serve what we have; the scrape must not fail
        yield from families
        yield from self.recoveries.collect()

    def _workers(self, now: float, seen: dict[str, float], alive: set[str]):
        infos = self.src.store.workers(sorted(alive))
        states = Counter(info.get("state", "unknown") for info in infos.values())
        states["dead"] = len(seen) - len(alive)
        g = GaugeMetricFamily("meshkeeper_workers", "Workers by state", labels=["state"])
        for state in dict.fromkeys(("idle", "busy", "dead", *states)):
            g.add_metric([state], states.get(state, 0))
        yield g
        age = GaugeMetricFamily(
            "meshkeeper_worker_heartbeat_age_seconds",
            "Since each registered worker's last heartbeat",
            labels=["worker"],
        )
        for w, t in seen.items():
            age.add_metric([w], max(0.0, now - t))
        yield age

    def _jobs(self, now: float, alive: set[str]):
        store, k = self.src.store, self.src.store.keys
        jids = store.job_ids()
        pipe = store.r.pipeline(transaction=False)
        for jid in jids:
            pipe.hget(k.job(jid), "phase")
        phases = dict(zip(jids, pipe.execute(), strict=True))
        g = GaugeMetricFamily("meshkeeper_jobs", "Jobs by phase", labels=["phase"])
        counts = Counter(phases.values())
        for ph in PHASES:
            g.add_metric([ph], counts.get(ph, 0))
        yield g

        open_ids = [j for j, ph in phases.items() if ph and ph not in TERMINAL]
        # jobs that ended since the last scrape are read once more for their last recoveries
        wanted = list(dict.fromkeys([*open_ids, *(self.recoveries.tracked & set(jids))]))
        raws = store.jobs(wanted)
        jobs = {jid: job for jid in wanted if (job := Job.from_hash(jid, raws[jid])) is not None}
        fams = JobFamilies()
        for jid in open_ids:
            if jid in jobs:
                fams.add(store, jobs[jid], now, alive)
        if self.src.leading():
            self.recoveries.feed({jid: job.recoveries for jid, job in jobs.items()}, set(open_ids))
        yield from fams.families()
