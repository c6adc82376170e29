"""Runs the reconcile pass early when an agent announces a trainer's exit (docs/architecture.md,
"Controller").

Agents publish on `controller:wake` right after they report an exit. One thread listens and
sets an event; the reconcile loop waits on that event instead of sleeping out its interval, so
a killed rank is acted on a few milliseconds after its agent saw it, not up to a pass interval
later. The message is only a nudge: the pass reads everything it decides on from Redis, as
always. Lost messages (pub/sub is lossy, Redis may be away) cost nothing but that latency: the
interval still runs the pass. Woken passes start at least `min_gap_s` apart, so a flood of
announcements (or an agent that publishes in a loop) cannot keep the controller busy.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from services.store import Store

log = logging.getLogger("meshkeeper.controller")

LISTEN_POLL_S = 0.5  # how often the listener looks at `stop` while no message comes
RETRY_S = 1.0  # after a Redis error, before subscribing again


class Wakeup:
    def __init__(self, store: Store, stop: threading.Event, min_gap_s: float = 0.05):
        self.store, self.stop, self.min_gap_s = store, stop, min_gap_s
        self.event = threading.Event()
        self.woken = 0  # announcements received (the tests read it)
        self._last_pass = 0.0

    def wait(self, interval_s: float) -> None:
        """Until an announcement or `interval_s`, but not before `min_gap_s` after the last
        pass; returns at once when `stop` is set."""
        gap = self._last_pass + self.min_gap_s - time.monotonic()
        if gap > 0 and self.stop.wait(gap):
            return
        self.event.wait(max(0.0, interval_s - max(gap, 0.0)))
        self.event.clear()
        self._last_pass = time.monotonic()

    def interrupt(self) -> None:
        """Wake the loop now (on stop)."""
        self.event.set()

    def listen(self) -> None:
        """The listener thread's body: subscribe, set the event per message, resubscribe after
        a Redis error, until `stop`."""
        channel = self.store.keys.controller_wake()
        while not self.stop.is_set():
            ps = None
            try:
                ps = self.store.r.pubsub(ignore_subscribe_messages=True)
                ps.subscribe(channel)
                while not self.stop.is_set():
                    if ps.get_message(timeout=LISTEN_POLL_S):
                        self.woken += 1
                        self.event.set()
            except (redis.RedisError, OSError) as e:
                log.debug("wake-up channel: %s; subscribing again in %.0fs", e, RETRY_S)
                self.stop.wait(RETRY_S)
            finally:
                if ps is not None:
                    try:
                        ps.close()
                    except (redis.RedisError, OSError):
                        pass
