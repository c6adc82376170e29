"""One controller replica: its Redis store, its lease, and the reconcile loop it runs while
leading."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import redis
from tenacity import Retrying, retry_if_exception_type, wait_random_exponential

from controller.admission import AdmissionConfig
from controller.availability import RedisAvailability
from controller.lease import LeaseKeeper
from controller.metrics import ControllerMetrics, Scraped
from controller.pods import PodReplacer
from controller.pool_limits import PoolLimits
from controller.retention import Retention, RetentionConfig
from controller.scheduler import Scheduler, SchedulerConfig
from controller.wakeup import Wakeup
from services.store import Fenced, Store

log = logging.getLogger("meshkeeper.controller")

# Under Sentinel: how often the leader copies the master's ACL users to the replicas, for a
# replica that was away when an agent joined (joins copy them at once: Store.save_acl)
ACL_SYNC_S = 10.0
# How often the leader checks every agent user's checkpoint grant against its pointer
# (Store.reconcile_grants; also at once under each new lease): one ACL LIST and one pipelined
# read, a few ms at 500 workers
ACL_GRANTS_S = 60.0


@dataclass(frozen=True)
class ControllerConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    # the Redis user that manages agent users (services/store.py `provisioner_acl`); None:
    # agents cannot join (only --insecure-direct-redis agents, with the controller's own URL)
    provisioner_url: str | None = None
    prefix: str = "mk:"
    lease_ttl_s: float = 3.0
    interval_s: float = 0.25
    scheduler: SchedulerConfig = SchedulerConfig()
    agent_redis_url: str | None = None  # what /v1/agent/bootstrap tells agents (default: ours)
    admission: AdmissionConfig = (
        AdmissionConfig()
    )  # data/checkpoint roots (controller/admission.py)
    retention: RetentionConfig = RetentionConfig()  # bounded state (controller/retention.py)
    pool_limits: PoolLimits = PoolLimits()  # what a tenant's spec may ask (pool_limits.py)


# A pass takes milliseconds to a few seconds (2 s at 16,384 ranks, bench/scale.py); one that
# has not completed for this long keeps failing, and the replica is not ready.
PASS_OVERDUE_S = 15.0


class Controller:
    def __init__(self, cfg: ControllerConfig):
        self.cfg = cfg
        self.id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        self.store = Store(
            cfg.redis_url,
            cfg.prefix,
            mirror_progress=True,
            provisioner_url=cfg.provisioner_url,
            provisions=cfg.provisioner_url is not None,
        )
        self.lease = LeaseKeeper(self.store, self.id, cfg.lease_ttl_s)
        # Redis as this controller sees it: silence is judged only while it was there for all
        self.availability = RedisAvailability()
        self.pods = PodReplacer.from_environment(self.store)  # None outside Kubernetes
        self.scheduler = Scheduler(
            self.store, cfg.scheduler, self.id, availability=self.availability, actions=self.pods
        )
        self.retention = Retention(self.store, cfg.retention)
        self.metrics = ControllerMetrics(
            Scraped(self.store, self.id, lambda: self.leading, cfg.scheduler.worker_alive_s)
        )
        self._next_acl_sync = 0.0
        self._grants_checked: tuple[str | None, float] = (None, 0.0)  # (under lease, when)
        self.pass_done_at = time.monotonic()  # the last reconcile pass that completed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)
        # Redis's availability is timed by a thread of its own, never by the passes: a long
        # pass (a big recovery written) is no gap in Redis taking beats (availability.py)
        self._watcher = threading.Thread(
            target=self.availability.watch,
            args=(self.store, self._stop),
            name="redis-watch",
            daemon=True,
        )
        # an agent's announcement of a trainer exit runs the pass at once (controller/wakeup.py)
        self.wakeup = Wakeup(self.store, self._stop)
        self._listener = threading.Thread(target=self.wakeup.listen, name="wakeup", daemon=True)
        # A failed pass is retried after a jittered exponential wait (0.1 s doubling, at most
        # 2 s), so a Redis outage or a bug is not hammered 4 times a second; stop() ends it.
        self._retrying = Retrying(
            wait=wait_random_exponential(multiplier=0.1, max=2.0),
            sleep=self._stop.wait,
            retry=retry_if_exception_type(Exception),
            stop=lambda _: self._stop.is_set(),
            retry_error_callback=lambda _: None,
        )

    @property
    def leading(self) -> bool:
        return self.lease.current() is not None

    def start(self) -> None:
        self.lease.start()
        self._watcher.start()
        self._listener.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.wakeup.interrupt()
        self._thread.join(timeout=5)
        self._watcher.join(timeout=5)
        self._listener.join(timeout=5)
        if self.pods is not None:
            self.pods.close()
        self.lease.stop()
        self.store.close()

    def _loop(self) -> None:
        while True:
            self.wakeup.wait(self.cfg.interval_s)
            if self._stop.is_set():
                return
            self._retrying(self._pass)

    def pass_overdue_s(self) -> float | None:
        """How long since the last reconcile pass completed, once that is over PASS_OVERDUE_S
        (a pass that keeps failing: /readyz answers 503); None while passes complete."""
        since = time.monotonic() - self.pass_done_at
        return since if since > PASS_OVERDUE_S else None

    def _check_grants(self, lease: str) -> None:
        under, at = self._grants_checked
        if under == lease and time.monotonic() - at < ACL_GRANTS_S:
            return
        if stale := self.store.reconcile_grants():
            log.warning("corrected the checkpoint grants of %s (left by an earlier pass)", stale)
        self._grants_checked = (lease, time.monotonic())

    def _pass(self) -> None:
        """One reconcile pass while leading. Raises what should be retried after a wait."""
        lease = self.lease.current()
        if lease is None:
            self.pass_done_at = time.monotonic()  # nothing to do is done
            return
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            self.scheduler.run_once(lease)
            self.retention.run_due(lease)
            self._check_grants(lease)
            if self.store.sentinel is not None and time.monotonic() >= self._next_acl_sync:
                self._next_acl_sync = time.monotonic() + ACL_SYNC_S
                if changed := self.store.sync_acl():
                    log.info("copied %d ACL user change(s) to the Redis replicas", changed)
            self.pass_done_at = time.monotonic()
        except Fenced:  # not retried: the next pass finds the lease gone
            log.warning("a write was fenced: another controller leads now")
        except redis.RedisError as e:  # the watcher logs the outage once, and times it
            log.debug("reconcile pass: Redis unavailable (%s); retrying", e)
            raise
        except Exception:  # a bug must not kill the loop; it is logged and retried
            log.exception("reconcile pass failed")
            raise
        finally:
            self.metrics.pass_seconds.observe(time.perf_counter() - t0)
            self.metrics.pass_cpu_seconds.observe(time.thread_time() - cpu0)
