"""The health probe a quarantined worker must pass before it rejoins the pool.

`python -m worker.agent.probe` (run by the agent, `Prober`): a matmul checked against a result known
exactly, then a gloo all-reduce between two processes over localhost TCP; on a worker with
GPUs, every GPU also allocates 1 GiB and runs the same matmul, and one NCCL all-reduce runs
across all of them. Prints one JSON
line and exits 0 on a pass, 1 on a failure. The controller quarantines a worker it blamed
(controller/faults.py) in `worker:{wid}:health`; once `quarantined_until` has passed, the
agent runs this probe and writes `worker:{wid}:probe` {passed, at, detail}; only a pass taken
after the quarantine ended re-admits the worker (`FaultHandler.admissible`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import redis

from services.procs import die_with_parent, free_port, stop_all

log = logging.getLogger("meshkeeper.agent")
PROBE_TIMEOUT_S = 60.0
RETRY_AFTER_FAIL_S = 30.0
CHECK_EVERY_S = 2.0
N = 64


def _operands() -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Two small-integer matrices and their exact product."""
    a = [[(i * 7 + j * 3) % 11 - 5 for j in range(N)] for i in range(N)]
    b = [[(i * 5 + j * 13) % 9 - 4 for j in range(N)] for i in range(N)]
    want = [[sum(a[i][k] * b[k][j] for k in range(N)) for j in range(N)] for i in range(N)]
    return a, b, want


def _matmul(device: str = "cpu") -> str | None:
    """Small integers in fp32: every product and partial sum is exact, so the result must
    equal the integer one bit for bit (a flaky core, a bad BLAS build or a faulty GPU does
    not)."""
    import torch

    a, b, want = _operands()
    fp32 = {"dtype": torch.float32, "device": device}
    got = (torch.tensor(a, **fp32) @ torch.tensor(b, **fp32)).tolist()
    bad = sum(1 for i in range(N) for j in range(N) if got[i][j] != want[i][j])
    return f"matmul on {device}: {bad} of {N * N} entries wrong" if bad else None


GPU_ALLOC_BYTES = 1 << 30  # each GPU must still give out this much


def _gpus() -> tuple[list[str], int]:
    """On every GPU this worker's trainers would see: a 1 GiB allocation, the exact GEMM, and
    one NCCL all-reduce across all of them (one process, a tensor per GPU). (problems, GPUs)"""
    import torch

    if not torch.cuda.is_available():
        return [], 0
    count, problems = torch.cuda.device_count(), []
    for i in range(count):
        try:
            torch.empty(GPU_ALLOC_BYTES, dtype=torch.uint8, device=f"cuda:{i}")
            problems += [p for p in (_matmul(f"cuda:{i}"),) if p]
        except RuntimeError as e:  # an allocation, an Xid, an ECC error: all fail the probe
            problems.append(f"cuda:{i}: {str(e).splitlines()[0]}")
    if not problems:
        try:
            import torch.cuda.nccl as nccl

            tensors = [torch.full((1024,), float(i + 1), device=f"cuda:{i}") for i in range(count)]
            nccl.all_reduce(tensors)
            want = count * (count + 1) / 2
            if not all(bool((t == want).all()) for t in tensors):
                problems.append(f"NCCL all-reduce over {count} GPU(s) gave a wrong sum")
        except RuntimeError as e:
            problems.append(f"NCCL all-reduce: {str(e).splitlines()[0]}")
    return problems, count


def _allreduce_rank(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=20))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=20))
    t = torch.full((1024,), float(rank + 1))
    pg.allreduce([t]).wait()
    if not bool((t == 3.0).all()):
        raise RuntimeError(f"all-reduce gave {t[:4].tolist()}..., want 3.0")


def _collective() -> str | None:
    """Two processes (this one and a fork) all-reduce over gloo on localhost."""
    port = free_port()
    pid = os.fork()
    if pid == 0:  # the peer: report by exit code only
        try:
            _allreduce_rank(1, port)
            os._exit(0)
        except BaseException:  # noqa: BLE001 (any failure is a failed probe)
            os._exit(1)
    try:
        _allreduce_rank(0, port)
    except Exception as e:  # noqa: BLE001
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return f"gloo all-reduce: {e}"
    _, status = os.waitpid(pid, 0)
    return (
        None
        if os.waitstatus_to_exitcode(status) == 0
        else "gloo all-reduce: the peer process failed"
    )


def main() -> int:
    die_with_parent(signal.SIGKILL, int(os.environ.get("MESHKEEPER_AGENT_PID", "0")))
    t0 = time.monotonic()
    # the collective first: fork before torch starts any thread pool of its own
    problems = [p for p in (_collective(), _matmul()) if p]
    on_gpus, gpus = _gpus()
    problems += on_gpus
    ok = "matmul and gloo all-reduce ok" + (
        f"; allocation, matmul and NCCL all-reduce ok on {gpus} GPU(s)" if gpus else ""
    )
    print(
        json.dumps(
            {
                "passed": not problems,
                "detail": "; ".join(problems) or ok,
                "seconds": round(time.monotonic() - t0, 2),
            }
        ),
        flush=True,
    )
    return 1 if problems else 0


class Prober:
    """The agent's side: while idle and quarantined past its end, run the probe (in the
    background: the agent loop never waits on it) and report the result."""

    def __init__(
        self, store, wid: str, env: dict[str, str], run_dir: Path, now: Callable[[], float]
    ):
        self.store, self.wid, self.env, self.run_dir, self.now = store, wid, env, run_dir, now
        self.proc: subprocess.Popen | None = None
        self._started = 0.0
        self._until = 0.0
        self._next = 0.0

    def _key(self, what: str) -> str:
        return self.store.keys.worker(self.wid) + f":{what}"

    def tick(self) -> None:
        try:
            self._tick()
        except redis.RedisError:
            pass  # next tick

    def _tick(self) -> None:
        if self.proc is not None:
            self._collect()
            return
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + CHECK_EVERY_S
        until = float(self.store.r.hget(self._key("health"), "quarantined_until") or 0)
        if not until or self.now() < until:
            return
        probe = self.store.r.hgetall(self._key("probe"))
        if float(probe.get("at") or 0) >= until:
            return  # already reported for this quarantine (a failure is retried below)
        self._until, self._started = until, time.monotonic()
        out = open(self.run_dir / "probe.log", "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker.agent.probe"],
                stdout=subprocess.PIPE,
                stderr=out,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**self.env, "MESHKEEPER_AGENT_PID": str(os.getpid())},
            )
        finally:
            out.close()
        log.info("quarantine over: running the health probe (pid %d)", self.proc.pid)

    def _collect(self) -> None:
        code = self.proc.poll()
        if code is None and time.monotonic() - self._started < PROBE_TIMEOUT_S:
            return
        if code is None:
            stop_all([self.proc], 1.0)
            result = {"passed": False, "detail": f"probe did not finish in {PROBE_TIMEOUT_S:.0f}s"}
        else:
            lines = self.proc.stdout.read().decode(errors="replace").strip().splitlines()
            try:
                result = json.loads(lines[-1])
            except (IndexError, ValueError):
                result = {"passed": False, "detail": f"probe exited {code} without a result"}
            result["passed"] = bool(result.get("passed")) and code == 0
        self.proc.stdout.close()
        self.proc = None
        at = self.now()
        if not result["passed"]:
            at = self._until - 1  # not "taken after the quarantine": retried, never admits
            self._next = time.monotonic() + RETRY_AFTER_FAIL_S
        self.store.r.hset(
            self._key("probe"),
            mapping={
                "passed": "1" if result["passed"] else "0",
                "at": at,
                "detail": result.get("detail", ""),
                "quarantined_until": self._until,
            },
        )
        (log.info if result["passed"] else log.warning)(
            "health probe %s: %s", "passed" if result["passed"] else "FAILED", result.get("detail")
        )

    def close(self) -> None:
        if self.proc is not None:
            stop_all([self.proc], 1.0)
            self.proc = None


if __name__ == "__main__":
    sys.exit(main())
