"""In-place restart (issue 48): a healthy rank keeps its process across a recovery.

When a recovery gives this rank's worker the next generation of the same job, its agent does
not stop the trainer: it writes an order for it, the next generation's argv, environment
and log (`{run_dir}/jobs/{job}/rank{r}.handoff.json`, written whole). The trainer
- unwinds: a watcher thread polls for the order and, once one arrives, aborts every
  collective in flight. Gloo cannot be aborted from inside (torch 2.13's
  `ProcessGroupGloo.abort` leaves a blocked collective blocked, tried), but its transport
  fails an operation at once when its socket is shut: so the watcher shuts every TCP
  connection this process holds (gloo's pairs and the rendezvous store's clients; listening
  sockets stay). The training thread's collective raises, `run`'s teardown destroys the
  groups, and the peers of this rank's closed connections fail the same way;
- parks: a rank whose collective failed because a peer did (gloo's "Connection closed by
  peer" after a peer's exit, or any torch.distributed error) waits for its order instead of
  exiting, at most `park_s`; without an order by then it exits with its error as before, so
  a recovery the controller never starts is reported as it always was;
- takes the order: its output goes to the new generation's log, its environment becomes the
  new rank's (the new rendezvous port), and `main` runs the new generation in this process.
  The state comes back from the snapshot in this host's memory, as a fresh process's would.

Only gloo-only (CPU) trainers take orders for now: on CUDA the NCCL communicators would need
`_abort_process_group` with the watchdog's own abort disarmed, never run on a GPU here, so a
GPU trainer says it is not restartable and its agent starts a fresh process, as before.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import psutil
import torch.distributed as dist

from worker.handoff_order import Order

POLL_S = 0.01  # the order file's stat: a few microseconds each


def abort_connections() -> int:
    """Shut every established TCP connection of this process; how many were shut. A
    connection gloo or the store closes meanwhile is skipped (its descriptor is gone)."""
    shut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or conn.fd < 0:
            continue
        try:
            with socket.socket(fileno=os.dup(conn.fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            continue
    return shut


def peer_failed(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is a collective that failed because a peer did:
    gloo's transport errors name their source file, torch's own are DistErrors."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, dist.DistError) or "gloo/transport" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Handoff:
    """The watcher of one generation's run in this process."""

    def __init__(self, path: Path, generation: int, park_s: float):
        self.path, self.generation, self.park_s = path, generation, park_s
        self.order: Order | None = None
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="handoff", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if self._take():
                abort_connections()
                return

    def _take(self) -> bool:
        if not self.path.exists():
            return False
        order = Order.read(self.path)
        if order is None or order.generation <= self.generation:
            return False
        self.order = order
        self._arrived.set()
        return True

    def may_follow(self, error: BaseException) -> bool:
        """Whether an order may follow `error`, which ended this generation's run: one has
        arrived (its abort caused the error), or a peer's failure did (a recovery comes)."""
        return self._arrived.is_set() or peer_failed(error)

    def wait(self) -> Order | None:
        """The order, waited for up to `park_s`; None: none came, exit as before."""
        self._arrived.wait(self.park_s)
        return self.order

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.order is not None:
            self.path.unlink(missing_ok=True)  # taken: a later start must not read it again
