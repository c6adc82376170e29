"""A trainer process kept warm: torch and the trainer are imported before any assignment.

The agent starts `python -m worker.agent.warm` ahead of time. It imports torch and the trainer
(~4 s on a small machine), then blocks on one JSON line on stdin:
    {"argv": [...], "env": {...}, "log": "/path/rank0.log"}
and becomes that rank: stdout and stderr go to the log, the environment (RANK, WORLD_SIZE,
MASTER_ADDR, ...) is applied, and the trainer's `main(argv)` runs; its return code is the exit
code. EOF on stdin (the agent closed the pipe or died) exits at once. The process also dies
with its agent (PR_SET_PDEATHSIG), so no trainer outlives the agent supervising it.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from services.procs import die_with_parent


def become(order: dict) -> None:
    fd = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(order["env"])


def main() -> int:
    die_with_parent(signal.SIGKILL, int(os.environ.get("MESHKEEPER_AGENT_PID", "0")))
    import torch  # noqa: F401  (the whole point: pay the import before the assignment)

    from worker.trainer.main import main as train

    print(f"[meshkeeper] warm trainer ready (pid {os.getpid()})", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    order = json.loads(line)
    become(order)
    print(
        f"[meshkeeper] warm trainer pid {os.getpid()} takes rank {order['env'].get('RANK')}",
        flush=True,
    )
    return train(order["argv"])


if __name__ == "__main__":
    sys.exit(main())
