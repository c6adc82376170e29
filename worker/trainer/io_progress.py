"""Progress during long I/O (issue 45): while a save, a restore or a weight import is open,
a thread writes an `io` line to the rank's metrics file every `interval_s`:

    {"event": "io", "phase": "save", "step": 200, "elapsed_s": 35.0}

Any line is progress to the agent (worker/agent/rank_progress.py), so a save to slow
storage that outlasts `hang_after_s` keeps the rank alive in the controller's eyes (it was
blamed as hung, and its process in D state on NFS as frozen), while a rank that stops
anywhere else is still found within `hang_after_s`. The line names the phase, so a slow save
reads as one in the job's log."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class IoProgress:
    def __init__(self, write: Callable[[dict], None], hang_after_s: float):
        self.write = write
        # several lines within every hang bound, and no more than one a second
        self.interval_s = max(1.0, min(10.0, hang_after_s / 4))

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        start, done = time.monotonic(), threading.Event()

        def tick() -> None:
            while not done.wait(self.interval_s):
                elapsed = round(time.monotonic() - start, 1)
                self.write({"event": "io", "phase": name, "step": step, "elapsed_s": elapsed})

        ticker = threading.Thread(target=tick, name=f"io-{name}", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
