"""`python -m tests.rankrun --nproc-per-node=N -m MODULE [ARGS...]`: N local ranks of
`python -m MODULE ARGS` with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), rank 0 hosting the rendezvous store, as an agent
starts a generation's ranks (docs/architecture.md, "Agent").

It stands in for `torchrun --standalone` in the tests: torchrun's launcher imports torch
(about 2 s of CPU) before any rank starts, and then every rank imports it again. Here the
launcher imports MODULE once and forks the ranks from itself: a rank starts with nothing left
to import, and a reference run costs one import instead of N. What the tests relied on is
kept: each rank in a session of its own that dies with the launcher; when a rank fails, the
others are stopped (SIGTERM, SIGKILL after 5 s) and the launcher exits 1; the ranks' output
goes straight through (a failing rank's traceback lines carry torch's own `[rankN]` prefix).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import signal
import sys
import traceback

from services.procs import Child, die_with_parent, fork_call, free_port, stop_all

USAGE = (
    "usage: python -m tests.rankrun --nproc-per-node=N -m MODULE [ARGS...]\n"
    "       python -m tests.rankrun --serve -m MODULE"
)
STOP_GRACE_S = 5.0


def parse(argv: list[str]) -> tuple[int, str, list[str]]:
    """(world size, module, its arguments), in torchrun's own argument order."""
    flag, _, n = argv[0].partition("=") if argv else ("", "", "")
    if flag != "--nproc-per-node" or not n.isdigit() or int(n) < 1 or argv[1:2] != ["-m"]:
        raise SystemExit(USAGE)
    if len(argv) < 3:
        raise SystemExit(USAGE)
    return int(n), argv[2], argv[3:]


def preload(module: str) -> None:
    """Import what the ranks' entry imports, once, before the forks: the module, and a
    package's `main` module where it has one (worker.trainer's __main__ only calls it)."""
    mod = importlib.import_module(module)
    if hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.main") is not None:
        importlib.import_module(f"{module}.main")


def rank_main(module: str, args: list[str], env: dict[str, str]) -> int:
    """In a forked rank: `python -m MODULE ARGS` with the rank's environment; its exit code."""
    os.setsid()
    die_with_parent(signal.SIGKILL)
    # a stream of its own, line-buffered: each line in one write, never split by another rank's
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(env)
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1


def fork_rank(module: str, args: list[str], env: dict[str, str]) -> Child:
    return Child(fork_call(lambda: rank_main(module, args, env)))


def run(world: int, module: str, args: list[str]) -> int:
    """Start every rank, wait for them all; 0 if every rank exited 0, else 1 once the first
    failure stopped the others."""
    preload(module)
    common = {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    ranks = {
        p.pid: (rank, p)
        for rank in range(world)
        for p in [fork_rank(module, args, {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)})]
    }
    while ranks:
        pid, status = os.wait()
        if pid not in ranks:
            continue
        rank, p = ranks.pop(pid)
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Child.poll
        if p.returncode != 0:
            print(f"[rankrun] rank {rank} exited with {p.returncode}", file=sys.stderr, flush=True)
            stop_all([q for _, q in ranks.values()], STOP_GRACE_S)
            return 1
    return 0


def launcher(order: dict) -> int:
    """In a forked launcher of the server: one run, its output in the order's files."""
    os.setsid()
    die_with_parent(signal.SIGKILL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, order["out"]), (2, order["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(order["cwd"])
    return run(int(order["world"]), order["module"], list(order["args"]))


def answer(reply: dict) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def serve(module: str) -> int:
    die_with_parent(signal.SIGKILL)
    preload(module)
    answer({"ready": os.getpid()})
    while line := sys.stdin.readline():
        order = json.loads(line)
        pid = fork_call(lambda order=order: launcher(order))
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"code": os.waitstatus_to_exitcode(status)})
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        if sys.argv[2:3] != ["-m"] or len(sys.argv) != 4:
            raise SystemExit(USAGE)
        return serve(sys.argv[3])
    return run(*parse(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
