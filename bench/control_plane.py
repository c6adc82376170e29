"""Helpers for the control-plane benchmarks: a local stack in a temp dir, percentiles, jobs."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from cli.local_stack import LocalStack, StackConfig
from services.client import Client
from services.procs import free_port

TINY = {
    "name": "bench",
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "seed": 7},
    "parallel": {"dp": 2},
    "train": {"steps": 3, "global_batch": 16, "lr": 3e-3},
}


@contextlib.contextmanager
def local_stack(workers: int, warm: int = 1) -> Iterator[tuple[LocalStack, Client]]:
    with tempfile.TemporaryDirectory(prefix="mk-bench-") as d:
        stack = LocalStack(
            StackConfig(workers=workers, port=free_port(), run_dir=Path(d), warm=warm)
        )
        try:
            stack.start()
            with Client(stack.url, stack.secrets.admin_token) as client:
                yield stack, client
        except BaseException:
            # the run dir goes with the temp dir: show the controller's last words first
            log = stack.logs / "controller.log"
            if log.exists():
                print(f"--- {log} (tail)\n{log.read_text(errors='replace')[-3000:]}")
            raise
        finally:
            stack.stop()


def warm_ready(stack: LocalStack, expected: int, timeout: float = 120) -> None:
    """Wait until `expected` agents' trainer zygotes have imported torch (each says so in its
    log, worker/agent/zygote.py)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = (stack.cfg.run_dir / "workers").glob("*/zygote.log")
        if sum("trainer zygote ready" in p.read_text(errors="replace") for p in logs) >= expected:
            return
        time.sleep(0.1)
    raise SystemExit(f"trainer zygotes not ready within {timeout}s; see {stack.cfg.run_dir}")


def wait_idle(client: Client, workers: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(w.alive and w.state == "idle" and not w.job for w in client.workers()) >= workers:
            return
        time.sleep(0.1)
    raise SystemExit("workers did not return to idle")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def median(xs: list[float]) -> float:
    return statistics.median(xs)
