"""The job's rendezvous store, hosted by one agent for many generations (issue 48).

Before, rank 0's trainer hosted a TCPStore of each generation's own on a fresh port: a new
store every recovery, gone with rank 0 when rank 0 was the rank that failed. Now the agent of
the worker the assignment names (`Assignment.store_wid`) runs the job's store in a process of
its own, forked from its zygote (torch is already imported there), and keeps it across
generations for as long as the controller keeps the store there (controller/apply.py
`job_store`). Every trainer, rank 0 too, is a client; each generation rendezvouses in a key
space of its own (`Assignment.store_space`), so a superseded trainer that still runs never
meets the new generation's keys. The store's server is torch's libuv one (the default since
PyTorch 2.4), built for thousands of clients.

The process dies with its agent (PR_SET_PDEATHSIG): the worker is then dead to the
controller, which starts the store on the next generation's rank 0 worker, on a fresh port.

`python -m worker.agent.job_store --port P` runs the store cold (no zygote).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
from pathlib import Path

from services.procs import Child, die_with_parent, stop_all

MODULE = "worker.agent.job_store"


class JobStore:
    """The agent's handle on the store process of one job."""

    def __init__(self, job: str, port: int, proc: Child | subprocess.Popen):
        self.job, self.port, self.proc = job, port, proc

    @property
    def key(self) -> tuple[str, int]:
        return self.job, self.port

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_all([self.proc], grace_s=1.0)


def main(argv: list[str]) -> int:
    """Serve the store on `--port` until stopped (SIGTERM, or the agent's death)."""
    import torch.distributed as dist  # here: the agent imports this module, never torch

    p = argparse.ArgumentParser(prog=MODULE)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    die_with_parent(signal.SIGKILL, int(os.environ.get("MESHKEEPER_AGENT_PID", "0")))
    # The name only addresses the server's own client; the server listens on every address.
    store = dist.TCPStore(
        "127.0.0.1",
        args.port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    print(
        f"[meshkeeper] job store (pid {os.getpid()}) listening on port {args.port}"
        f" (libuv: {store.libuvBackend})",
        flush=True,
    )
    while True:
        signal.pause()


def log_path(run_dir: Path, job: str) -> Path:
    """Where the store process writes: beside the job's generation directories."""
    d = run_dir / "jobs" / job
    d.mkdir(parents=True, exist_ok=True)
    return d / "store.log"


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
