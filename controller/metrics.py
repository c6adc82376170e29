"""Prometheus metrics of one controller (DESIGN.md section 8 naming).

Gauges about jobs, workers and ranks are read from Redis at scrape time (the controller keeps
no state of its own); histograms are observed in process. One registry per controller, no
process-global registry.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import redis
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controller.conditions import PHASES
from controller.jobs import Job
from controller.ranks import rank_view
from services.assignment import RANK_STATES, Assignment

if TYPE_CHECKING:
    from controller.service import Controller


class ControllerMetrics:
    def __init__(self, ctl: "Controller"):
        self.ctl = ctl
        self.registry = CollectorRegistry(auto_describe=True)
        self.pass_seconds = Histogram(
            "meshkeeper_scheduler_pass_duration_seconds", "One reconcile pass of the lease holder",
            registry=self.registry, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.http_seconds = Histogram(
            "meshkeeper_http_request_duration_seconds", "REST request latency",
            ["method", "route"], registry=self.registry,
            buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1))
        self.registry.register(_RedisCollector(ctl))


class _RedisCollector:
    def __init__(self, ctl: "Controller"):
        self.ctl = ctl

    def describe(self):
        return []

    def collect(self):
        leader = GaugeMetricFamily("meshkeeper_controller_leader",
                                   "1 while this replica holds the lease", labels=["controller"])
        leader.add_metric([self.ctl.id], 1.0 if self.ctl.leading else 0.0)
        yield leader
        try:
            yield from self._from_redis()
        except redis.RedisError:
            return  # Redis down: serve what we have; the scrape must not fail

    def _from_redis(self):
        store, alive_s = self.ctl.store, self.ctl.cfg.scheduler.worker_alive_s
        now = store.now()
        seen = store.workers_seen()
        alive = {w for w, t in seen.items() if t >= now - alive_s}
        infos = store.workers(sorted(alive))
        workers = Counter(infos[w].get("state", "unknown") for w in alive)
        workers["dead"] = len(seen) - len(alive)
        g = GaugeMetricFamily("meshkeeper_workers", "Workers by state", labels=["state"])
        for state in ("idle", "busy", "dead"):
            g.add_metric([state], workers.get(state, 0))
        yield g

        jids = store.job_ids()
        jobs = [j for j in (Job.from_hash(jid, h) for jid, h in store.jobs(jids).items()) if j]
        phases = Counter(j.phase for j in jobs)
        g = GaugeMetricFamily("meshkeeper_jobs", "Jobs by phase", labels=["phase"])
        for ph in PHASES:
            g.add_metric([ph], phases.get(ph, 0))
        yield g

        ranks: Counter = Counter()
        loss = GaugeMetricFamily("meshkeeper_train_loss", "Latest training loss", labels=["job"])
        tokens = CounterMetricFamily("meshkeeper_train_tokens", "Tokens trained", labels=["job"])
        for j in jobs:
            if j.phase in ("Running", "Recovering"):
                asg = Assignment.from_fields(store.job_assignment(j.id))
                if asg:
                    ranks.update(r["state"] for r in rank_view(asg, store.progress(asg.workers), alive))
            if j.loss is not None:
                loss.add_metric([j.id], j.loss)
            tr, m = j.spec.get("train", {}), j.spec.get("model", {})
            tokens.add_metric([j.id], j.step * tr.get("global_batch", 0) * m.get("seq_len", 0))
        g = GaugeMetricFamily("meshkeeper_ranks", "Ranks of running jobs by state", labels=["state"])
        for s in RANK_STATES:
            g.add_metric([s], ranks.get(s, 0))
        yield g
        yield loss
        yield tokens
