"""The agent's Prometheus endpoint (names: docs/architecture.md, "Observability").

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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services import discovery
from services.records import ExpertLoad, StepRecord
from services.spec import ModelSpec, ParallelSpec
from services.store import Store
from worker import mfu
from worker.agent.metrics_tail import CheckpointCommitted, CheckpointFailed, Restored, TrainerLine
from worker.agent.retry import Outage
from worker.peak_rss import own_resident

log = logging.getLogger("meshkeeper.agent")
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True)
class RankSnapshot:
    """One running rank, as the agent holds it at scrape time."""

    rank: int
    pid: int
    last: StepRecord | None  # its latest step
    spec: Path  # the spec file it runs (after a shrink, the shrunk mesh's)


@dataclass(frozen=True)
class AgentSnapshot:
    """What a scrape reads from the agent. The agent hands the endpoint a callable returning
    one, so this module never imports the agent (the agent imports it)."""

    job: str | None  # the job served, if any
    heartbeats: int
    heartbeat_failures: int
    ranks: tuple[RankSnapshot, ...]  # running ranks only


def _seconds(v: float | None) -> float | None:
    """A duration worth observing: a clock step backwards can make one negative."""
    return v if v is not None and v >= 0 else None


class AgentMetrics:
    def __init__(
        self, peak_flops: float | None = None, devices: int = 1, device_name: str | None = None
    ):
        """`peak_flops`: the operator's MFU denominator, for every job; else a GPU's comes
        from its datasheet by `device_name` (NVML's) and each job's precision, and a CPU's is
        an estimate from its cores."""
        self.explicit_peak, self.device_name = peak_flops, device_name
        self.peak_flops = (
            peak_flops
            or mfu.device_peak_flops(device_name, "bf16")
            or mfu.default_peak_flops(devices)
        )
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.step_seconds = Histogram(
            "meshkeeper_train_step_duration_seconds",
            "Training step wall time, one observation per rank step",
            ["job_id"],
            registry=reg,
            buckets=STEP_BUCKETS,
        )
        self.compute_seconds = Counter(
            "meshkeeper_train_compute_seconds", "Ranks' own compute time", ["job_id"], registry=reg
        )
        self.wait_seconds = Counter(
            "meshkeeper_train_collective_wait_seconds",
            "Ranks' time waiting in collectives",
            ["job_id"],
            registry=reg,
        )
        self.save_blocking = Histogram(
            "meshkeeper_checkpoint_save_blocking_seconds",
            "Training time a checkpoint save blocked, per rank",
            ["job_id"],
            registry=reg,
            buckets=SAVE_BUCKETS,
        )
        self.save_background = Histogram(
            "meshkeeper_checkpoint_save_background_seconds",
            "Time a checkpoint save ran behind training until committed, per rank",
            ["job_id"],
            registry=reg,
            buckets=SAVE_BUCKETS,
        )
        self.save_failures = Counter(
            "meshkeeper_checkpoint_save_failures",
            "Checkpoint saves that failed, per rank",
            ["job_id"],
            registry=reg,
        )
        self.restore_seconds = Histogram(
            "meshkeeper_checkpoint_restore_seconds",
            "Time a rank took to restore a checkpoint",
            ["job_id"],
            registry=reg,
            buckets=SAVE_BUCKETS,
        )
        # a MoE job's routing, from rank 0's step records (global counts; others carry none)
        self.expert_tokens = Counter(
            "meshkeeper_moe_expert_tokens",
            "Token choices each expert computed, over the global batch and every MoE layer",
            ["job_id", "expert"],
            registry=reg,
        )
        self.routed_tokens = Counter(
            "meshkeeper_moe_routed_tokens",
            "Token choices routed (computed or dropped), over every MoE layer",
            ["job_id"],
            registry=reg,
        )
        self.dropped_tokens = Counter(
            "meshkeeper_moe_dropped_tokens",
            "Token choices dropped over an expert's capacity",
            ["job_id"],
            registry=reg,
        )
        self.balance_loss = Gauge(
            "meshkeeper_moe_balance_loss",
            "The latest step's load-balancing loss, mean over MoE layers (1.0 is uniform)",
            ["job_id"],
            registry=reg,
        )
        self._labelled = (
            self.step_seconds,
            self.compute_seconds,
            self.wait_seconds,
            self.save_blocking,
            self.save_background,
            self.save_failures,
            self.restore_seconds,
            self.expert_tokens,
            self.routed_tokens,
            self.dropped_tokens,
            self.balance_loss,
        )
        ProcessCollector(registry=reg)  # the agent's own CPU and memory
        self._job: str | None = None
        self._lock = threading.Lock()

    # -- records the agent relays ------------------------------------------------------------
    def observe(self, job: str, line: TrainerLine) -> None:
        """One line of a trainer's metrics file (a step or an event) of `job`, the job served."""
        job = self.follow(job)
        if isinstance(line, StepRecord):
            for metric, v in (
                (self.step_seconds.labels(job).observe, line.step_s),
                (self.compute_seconds.labels(job).inc, line.compute_s),
                (self.wait_seconds.labels(job).inc, line.wait_s),
            ):
                if (v := _seconds(v)) is not None:
                    metric(v)
            if line.experts is not None:
                self._routing(job, line.experts)
        elif isinstance(line, CheckpointCommitted):
            blocking, total = _seconds(line.blocking_s), _seconds(line.total_s)
            if blocking is not None:
                self.save_blocking.labels(job).observe(blocking)
                if total is not None:
                    self.save_background.labels(job).observe(max(0.0, total - blocking))
        elif isinstance(line, CheckpointFailed):
            self.save_failures.labels(job).inc()
        elif isinstance(line, Restored) and (v := _seconds(line.restore_s)) is not None:
            self.restore_seconds.labels(job).observe(v)

    def _routing(self, job: str, load: ExpertLoad) -> None:
        for expert, n in enumerate(load.tokens):
            self.expert_tokens.labels(job, str(expert)).inc(n)
        self.routed_tokens.labels(job).inc(sum(load.tokens) + load.dropped)
        self.dropped_tokens.labels(job).inc(load.dropped)
        self.balance_loss.labels(job).set(load.balance_loss)

    def follow(self, job: str | None) -> str | None:
        """The job the agent serves now; children of a job it no longer serves are removed
        (every child is the served job's: the agent serves one job at a time)."""
        with self._lock:
            if self._job is not None and self._job != job:
                for m in self._labelled:
                    m.clear()
            self._job = job
        return job

    # -- wiring ---------------------------------------------------------------------------
    def watch(self, snapshot: Callable[[], AgentSnapshot]) -> None:
        """Read the agent through `snapshot` at every scrape."""
        self.registry.register(_AgentCollector(self, snapshot))

    def serve(self, host: str, port: int, store: Store, wid: str, address: str) -> None:
        """Serve on host:port and advertise it in Redis as worker `wid`'s endpoint (reached at
        `address` when bound to all interfaces)."""
        try:
            start_http_server(port, host, registry=self.registry)
        except OSError as e:  # a busy port must not keep the agent from working
            log.warning("metrics endpoint %s:%d not started: %s", host, port, e)
            return
        target = discovery.target_for(host, port, address)
        threading.Thread(
            target=_advertise, args=(store, wid, target), name="metrics-advertise", daemon=True
        ).start()


def _advertise(store: Store, wid: str, target: str) -> None:
    """Keep this endpoint in Redis for the controller's service discovery (a daemon thread:
    it ends with the agent's process)."""
    outage = Outage(
        redis.RedisError,
        1.0,
        threading.Event(),
        down=f"cannot advertise the metrics endpoint {target} (%s); retrying",
        back=f"metrics endpoint {target} advertised again",
    )
    while True:
        outage.call(lambda: discovery.advertise(store, wid, target))
        time.sleep(discovery.REFRESH_S)


class _AgentCollector:
    """Scrape-time state of the agent and its running ranks."""

    def __init__(self, metrics: AgentMetrics, snapshot: Callable[[], AgentSnapshot]):
        self.m, self.snapshot = metrics, snapshot
        # spec file -> (FLOPs/token, world, peak FLOP/s of a rank's device at its precision)
        self._specs: dict[Path, tuple[float, int, float] | None] = {}

    def describe(self):
        return []

    def collect(self):
        now = self.snapshot()
        yield CounterMetricFamily(
            "meshkeeper_agent_heartbeats", "Heartbeats written", value=now.heartbeats
        )
        yield CounterMetricFamily(
            "meshkeeper_agent_heartbeat_failures",
            "Heartbeats that could not reach Redis",
            value=now.heartbeat_failures,
        )
        yield GaugeMetricFamily(
            "meshkeeper_agent_peak_flops",
            "Configured peak FLOP/s of one rank (the MFU denominator)",
            value=self.m.peak_flops,
        )
        job = self.m.follow(now.job)
        yield GaugeMetricFamily(
            "meshkeeper_agent_trainers", "Trainer processes running", value=len(now.ranks)
        )
        labels = ["job_id", "rank"]
        gauges = {
            key: GaugeMetricFamily(name, doc, labels=labels)
            for key, name, doc in (
                ("step_s", "meshkeeper_rank_step_seconds", "Latest step wall time of each rank"),
                (
                    "compute_s",
                    "meshkeeper_rank_compute_seconds",
                    "Latest step's own compute time of each rank",
                ),
                (
                    "wait_s",
                    "meshkeeper_rank_collective_wait_seconds",
                    "Latest step's time in collectives of each rank",
                ),
            )
        }
        rss = GaugeMetricFamily(
            "meshkeeper_rank_resident_memory_bytes",
            "Resident memory of each rank's trainer process: its own pages, not those it "
            "shares with the zygote it was forked from or with other processes",
            labels=labels,
        )
        util = GaugeMetricFamily(
            "meshkeeper_train_mfu_ratio",
            "Model FLOPs utilisation: model FLOP/s "
            "of a rank over its configured peak (latest step)",
            labels=labels,
        )
        seen: set[Path] = set()
        for p in now.ranks:
            lv = [job, str(p.rank)]
            for key, g in gauges.items():
                if p.last is not None and (v := _seconds(getattr(p.last, key))) is not None:
                    g.add_metric(lv, v)
            if (mem := own_resident(p.pid)) is not None:
                rss.add_metric(lv, mem)
            seen.add(p.spec)
            model = self._model(p.spec)
            if model and p.last is not None and p.last.tokens_per_s > 0:
                util.add_metric(lv, mfu.mfu(model[0], p.last.tokens_per_s, model[1], model[2]))
        self._specs = {k: v for k, v in self._specs.items() if k in seen}  # only live runs' specs
        yield from gauges.values()
        yield rss
        yield util

    def _model(self, spec_path: Path) -> tuple[float, int, float] | None:
        """FLOPs per token, world size and the peak FLOP/s of one rank's device at its
        precision, for the spec a rank runs (the agent writes it beside the rank's metrics
        file; after a shrink it is the shrunk mesh's)."""
        if spec_path not in self._specs:
            try:
                spec = json.loads(spec_path.read_text())
                p = ParallelSpec(**spec["parallel"])
                peak = self.m.explicit_peak or mfu.device_peak_flops(
                    self.m.device_name, p.matmul_precision
                )
                self._specs[spec_path] = (
                    mfu.flops_per_token(ModelSpec(**spec["model"])),
                    p.world_size,
                    peak or self.m.peak_flops,
                )
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("no MFU for %s: %s", spec_path, e)
                self._specs[spec_path] = None
        return self._specs[spec_path]
