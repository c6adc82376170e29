"""Workers' progress hashes as the controller last read them: a read re-reads only the hashes
rewritten since the previous one (docs/architecture.md, "Redis keys": `workers:reported`).

A pass and every GET of a job need the reports of all its ranks' workers: 16,384 HGETALLs
per pass at full scale, most of them unchanged since the pass before. Agents rewrite
`worker:<wid>:progress` only through the REPORT script, which stamps the worker in
`workers:reported` with Redis server time in the same atomic step. So a read asks the index
which workers were stamped since the previous read's server time, re-reads those stamped
later than the copy it holds (and the ones it never read), and serves the rest from memory.

The index decides only what is re-read, never what a report says. What could make it miss a
rewrite is bounded here:
- a server clock a little behind the last one (a failover onto another host, a step of the
  clock): every read looks `SLACK_S` further back than the previous read's time;
- a restart or a failover, which can lose stamps the old server took (a new `run_id`), and
  any Redis error: everything is dropped and read again;
- an agent forging another worker's stamp (any agent may write the index, as it may write
  `workers:seen`): everything is re-read every `RESYNC_S` regardless.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import redis

SLACK_S = 0.1
RESYNC_S = 30.0


class ProgressMirror:
    def __init__(
        self,
        r: redis.Redis,
        index: str,
        key_of: Callable[[str], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`index`: the `workers:reported` key; `key_of(wid)`: a worker's progress key."""
        self._r, self._index, self._key_of, self._clock = r, index, key_of, clock
        self._lock = threading.Lock()  # the pass and the API's threads share one mirror
        # wid -> (its stamp when its hash was read, -inf for none; the hash)
        self._hashes: dict[str, tuple[float, dict[str, str]]] = {}
        self._since: float | None = None  # server time of the previous read's index query
        self._run_id: str | None = None  # the redis-server that time is from
        self._resync_at = 0.0
        self.reads = 0  # progress hashes read from Redis so far (for tests and the bench)

    def read(self, wids: list[str]) -> dict[str, dict[str, str]]:
        """wid -> its progress hash ({} when it has none), as of this call."""
        with self._lock:
            try:
                return self._read(wids)
            except Exception:
                self._drop()
                raise

    def _drop(self) -> None:
        self._hashes.clear()
        self._since = None

    def _read(self, wids: list[str]) -> dict[str, dict[str, str]]:
        if self._clock() >= self._resync_at:
            self._drop()
            self._resync_at = self._clock() + RESYNC_S
        pipe = self._r.pipeline(transaction=False)
        pipe.info("server")  # its run_id, and its time (before the index is asked)
        if self._since is not None:
            pipe.zrangebyscore(self._index, self._since - SLACK_S, "+inf", withscores=True)
        server, *changed = pipe.execute()
        now = int(server["server_time_usec"]) / 1e6
        if server["run_id"] != self._run_id or (
            self._since is not None and now < self._since - SLACK_S
        ):
            self._drop()  # another server, or its clock went back further than the slack
            self._run_id, changed = server["run_id"], []
        for wid, stamp in changed[0] if changed else ():
            if stamp > self._hashes.get(wid, (math.inf,))[0]:
                del self._hashes[wid]  # wanted now or not: what is kept must be current
        self._since = now
        missing = [w for w in dict.fromkeys(wids) if w not in self._hashes]
        if missing:
            # the stamps before the hashes: a report between the two leaves a hash newer
            # than its stamp says, read again next time (the other order could miss it)
            pipe = self._r.pipeline(transaction=False)
            pipe.zmscore(self._index, missing)
            for w in missing:
                pipe.hgetall(self._key_of(w))
            stamps, *hashes = pipe.execute()
            for w, stamp, h in zip(missing, stamps, hashes, strict=True):
                self._hashes[w] = (-math.inf if stamp is None else stamp, h)
            self.reads += len(missing)
        return {w: self._hashes[w][1] for w in wids}
