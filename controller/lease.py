"""Leader election: a Redis lease with a fencing token, renewed from its own thread.

`current()` answers only while the last renewal is recent by the local monotonic clock
(with a margin), so a controller cut off from Redis stops acting before the lease can pass to
another replica; and every write is fenced on the lease value in Redis anyway.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from services.store import Store

log = logging.getLogger("meshkeeper.lease")


class LeaseKeeper:
    def __init__(self, store: Store, holder: str, ttl_s: float = 3.0):
        self.store, self.holder, self.ttl_s = store, holder, ttl_s
        self._value: str | None = None
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)

    def current(self) -> str | None:
        """'holder:token' while we lead, else None."""
        return self._value if time.monotonic() < self._valid_until else None

    def tick(self) -> None:
        t0 = time.monotonic()
        try:
            v = self.store.acquire_lease(self.holder, self.ttl_s)
        except redis.RedisError as e:
            log.debug("lease renewal failed: %s", e)
            return  # keep the old validity; it runs out on its own
        if v and v != self._value:
            log.info("controller %s leads (fencing token %s)", self.holder, v.rsplit(":", 1)[1])
        elif not v and self.current():
            log.warning("controller %s lost the lease", self.holder)
        self._value = v
        self._valid_until = t0 + self.ttl_s * 0.7 if v else 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            self.tick()

    def start(self) -> None:
        self.tick()
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and hand the lease back at once, so a standby takes over quickly."""
        self._stop.set()
        self._thread.join(timeout=2)
        v, self._value = self._value, None
        if v:
            try:
                self.store.release_lease(v)
            except redis.RedisError:
                pass
