"""The trainer zygote: torch and the trainer imported once per agent, every trainer forked.

The agent starts `python -m worker.agent.zygote` when it starts (worker/agent/launcher.py). It
imports torch and the trainer (~4 s of CPU on a small machine), says so with one line on stdout,
`{"ready": PID}` (until then the agent starts its trainers cold rather than wait), then reads
one JSON line per trainer on stdin:
    {"argv": [...], "env": {...}, "log": "/path/rank0.log", "main": "worker.trainer.main"}
(`main`: the module whose main(argv) the child runs; the agent's other child is the job's
rendezvous store, worker/agent/job_store.py) and answers each with one line on stdout,
`{"pid": N}`: the trainer's pid, a process of the agent's own (below). The trainer starts
with nothing to import, so neither a first start nor a replacement in a recovery pays the
import again, and the import's memory pages are shared copy-on-write between the agent's
trainers.

Why a double fork: the agent must reap and watch its trainers as its own children (exit codes,
signals, the process tree; services/procs.Child). The agent is a child subreaper
(services/procs.become_subreaper), so a grandchild orphaned by the zygote's short-lived middle
child is re-parented to the agent. The trainer then waits until it is the agent's, starts its
own session (so stopping a rank signals everything it started), asks to die with the agent
(PR_SET_PDEATHSIG; set only once re-parented, or the middle child's exit would fire it),
takes its log and environment, and runs the trainer's `main(argv)`; its return value is the
exit code.

Forking is safe here: the zygote is single-threaded Python when it forks, nothing has touched
a device (CUDA initializes on first use, in the trainer), and the trainer seeds every random
stream it uses itself (docs/architecture.md, "Trainer").

`python -m worker.agent.zygote --cold ARGS...` is a trainer started cold instead (no zygote,
or a zygote that failed): it imports everything itself, and still dies with its agent.

EOF on stdin (the agent closed the pipe or died) ends the zygote; it also dies with its agent.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from services.procs import die_with_parent, fork_call, write_output_to

# Set by the agent for a rank it limits (spec `chaos.memory_limit`): the memory cgroup the
# trainer joins before it allocates anything of its own (worker/agent/memory_watch.py).
MEMORY_GROUP_ENV = "MESHKEEPER_MEMORY_CGROUP"
TRAINER_MAIN = "worker.trainer.main"


def join_memory_group() -> None:
    """Move this trainer into the group its agent made for it, if any. A failure ends the
    trainer (a traceback in its log, exit code 1): a rank must not run without the limit."""
    if group := os.environ.get(MEMORY_GROUP_ENV):
        Path(group, "cgroup.procs").write_text(str(os.getpid()))


def become(order: dict) -> None:
    """The forked trainer takes its session, log and environment."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    write_output_to(order["log"])
    os.environ.update(order["env"])


def trainer(order: dict, middle: int, agent: int) -> int:
    """In the forked trainer, once re-parented: run the rank (or the order's other `main`,
    the job's store: worker/agent/job_store.py); its exit code."""
    while os.getppid() == middle:  # the middle child exits at once; re-parenting follows
        time.sleep(0.001)
    die_with_parent(signal.SIGKILL, agent)  # exits 1 if the agent is already gone
    become(order)
    join_memory_group()
    module = order.get("main", TRAINER_MAIN)
    if module != TRAINER_MAIN:
        return importlib.import_module(module).main(order["argv"])
    from worker.trainer.main import main as train

    print(f"[meshkeeper] trainer pid {os.getpid()} forked for rank {order['env'].get('RANK')}")
    return train(order["argv"])


def fork(order: dict, agent: int) -> int:
    """Fork the trainer for `order` through a middle child; the trainer's pid."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        # Its own pid, taken before the fork: the trainer's getppid() may already name the
        # agent when it first runs (the middle child exits at once), and waiting to leave a
        # parent it has already left would wait forever.
        middle = os.getpid()

        def run() -> int | None:
            os.close(w)
            return trainer(order, middle, agent)

        os.write(w, str(fork_call(run)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        pid = int(f.read() or 0)
    os.waitpid(middle, 0)
    return pid


def main() -> int:
    agent = int(os.environ.get("MESHKEEPER_AGENT_PID", "0"))
    die_with_parent(signal.SIGKILL, agent)
    if sys.argv[1:2] == ["--cold"]:  # one trainer, no zygote: `--cold TRAINER_ARGS...`
        from worker.trainer.main import main as train

        gc.freeze()  # as the zygote does, below
        join_memory_group()  # after the import: a limit is on what the rank allocates
        return train(sys.argv[2:])
    import torch  # noqa: F401  (the whole point: pay the import once, before any rank)

    import worker.trainer.main  # noqa: F401

    # Every object the imports made moves to a generation the collector never scans: a
    # trainer's collections (each generation's teardown makes one, worker/trainer/handoff.py)
    # skip torch's whole object graph, and do not write to its pages, which stay shared
    # copy-on-write with the other trainers (Python's gc.freeze notes on fork)
    gc.freeze()
    print(f"[meshkeeper] trainer zygote ready (pid {os.getpid()})", file=sys.stderr, flush=True)
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    while line := sys.stdin.readline():
        if not line.strip():
            continue
        pid = fork(json.loads(line), agent)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
