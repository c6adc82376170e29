"""The agent's heartbeat: its own thread, so training, saving or a slow main loop never delay it.

Each beat stamps `workers:seen` with Redis server time and carries the job and generation
the agent currently serves (docs/architecture.md, "Generation and fencing"). Its answer is
also the agent's commit lease: a beat whose reply names the generation the agent serves
*confirms* that generation as of the moment the beat was sent; a reply naming another one
says the world was superseded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from services.store import Store
from worker.agent.retry import Outage

log = logging.getLogger("meshkeeper.agent")
BEAT_TIMEOUT_S = 0.5  # per connect and per reply; no retry inside the call (the loop retries)


class Heartbeat:
    def __init__(
        self,
        store: Store,
        wid: str,
        interval_s: Callable[[], float],
        serving: Callable[[], tuple[str, int]],
    ):
        """`interval_s`: read before every beat, so the agent beats at the interval of the job
        it serves now (its `fault_tolerance.heartbeat_s`), and at its own default when idle."""
        self.store, self.wid, self.interval_s, self.serving = store, wid, interval_s, serving
        # Its own connection, with a tight bound: a beat stuck on a dead or frozen connection must
        # fail fast and retry on a fresh one, or a healthy worker goes silent for the main Store's
        # ~4 s. One attempt blocks at most connect 0.5 s + reply 0.5 s = 1 s, then the next one
        # starts within interval_s (0.5 s by default): 1.5 s < dead_after_s (2 s by default,
        # and at least 2 x heartbeat_s). A beat that timed out may still land: Redis stamps it
        # when it runs it.
        self.store = Store(
            store.url,
            store.keys.prefix,
            credentials=store.credentials,
            socket_timeout=BEAT_TIMEOUT_S,
            connect_timeout=BEAT_TIMEOUT_S,
            retries=0,
        )
        self.beats = self.failures = 0
        self.clock_offset = 0.0  # Redis server time - local time: reports use server time
        self.superseded = threading.Event()  # a beat saw the pointer move away from what we serve
        self._confirmed: tuple[str, int, float] = (
            "",
            0,
            float("-inf"),
        )  # job, gen, monotonic send time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # an agent stopped during its first sync never beat
            self._thread.join(timeout=self.interval_s() + 6)
        self.store.close()

    def confirmed(self, job: str, generation: int, within_s: float) -> bool:
        """True when a beat sent less than `within_s` ago found (job, generation) current.
        The controller declares this worker dead only after `dead_after_s` of silence, so with
        `within_s` < `dead_after_s` it cannot have been replaced for silence yet (any other move
        of the generation is caught by the checkpoint CAS in Redis itself)."""
        cjob, cgen, at = self._confirmed
        return (cjob, cgen) == (job, generation) and time.monotonic() - at < within_s

    def _run(self) -> None:
        outage = Outage(
            redis.RedisError,
            self.interval_s(),
            self._stop,
            on_failure=self._failed,
            down="heartbeat failed (%s); retrying",
            back="heartbeats reach Redis again",
        )
        wait = 0.0
        while not self._stop.wait(wait):
            sent = outage.call(self._beat)
            if sent is None:  # stopped while Redis was away
                return
            wait = max(0.0, self.interval_s() - (time.monotonic() - sent))

    def _beat(self) -> float:
        """One beat; the monotonic time it was sent."""
        t0 = time.monotonic()
        job, gen = self.serving()
        beat = self.store.heartbeat(self.wid, job, gen)
        self.clock_offset = beat.time - time.time()
        if job and (beat.job, beat.generation) == (job, gen):
            self._confirmed = (job, gen, t0)  # current as of t0, not of the reply
        elif job:
            self.superseded.set()
        self.beats += 1
        return t0

    def _failed(self, _error: BaseException) -> None:
        self.failures += 1
