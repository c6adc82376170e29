"""`python -m tests.rankrun --nproc-per-node=N -m MODULE [ARGS...]`: N local ranks of
`python -m MODULE ARGS` with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), rank 0 hosting the rendezvous store, as an agent
starts a generation's ranks (docs/architecture.md, "Agent").

It stands in for `torchrun --standalone` in the tests: torchrun's launcher imports torch
(about 2 s of CPU) before any rank starts, and every reference run paid that. What the tests
relied on is kept: each rank in a session of its own that dies with the launcher; when a
rank fails, the others are stopped (SIGTERM, SIGKILL after 5 s) and the launcher exits 1;
the ranks' output goes straight through (a failing rank's traceback lines carry torch's own
`[rankN]` prefix).
"""

from __future__ import annotations

import os
import subprocess
import sys

from services.procs import die_with_parent, free_port, stop_all

USAGE = "usage: python -m tests.rankrun --nproc-per-node=N -m MODULE [ARGS...]"
STOP_GRACE_S = 5.0


def parse(argv: list[str]) -> tuple[int, str, list[str]]:
    """(world size, module, its arguments), in torchrun's own argument order."""
    flag, _, n = argv[0].partition("=") if argv else ("", "", "")
    if flag != "--nproc-per-node" or not n.isdigit() or int(n) < 1 or argv[1:2] != ["-m"]:
        raise SystemExit(USAGE)
    if len(argv) < 3:
        raise SystemExit(USAGE)
    return int(n), argv[2], argv[3:]


def run(world: int, module: str, args: list[str]) -> int:
    """Start every rank, wait for them all; 0 if every rank exited 0, else 1 once the first
    failure stopped the others."""
    common = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    ranks = {
        p.pid: (rank, p)
        for rank in range(world)
        for p in [
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        ]
    }
    while ranks:
        pid, status = os.wait()
        if pid not in ranks:
            continue
        rank, p = ranks.pop(pid)
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if p.returncode != 0:
            print(f"[rankrun] rank {rank} exited with {p.returncode}", file=sys.stderr, flush=True)
            stop_all([q for _, q in ranks.values()], STOP_GRACE_S)
            return 1
    return 0


def main() -> int:
    return run(*parse(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
