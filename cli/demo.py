"""`meshkeeper demo`: the whole path on this machine. A local stack, a small 3D job, one rank
SIGKILLed mid-run, the recovery watched live, the summary."""

from __future__ import annotations

import os
import signal

from cli import render
from cli.local_stack import LocalStack
from cli.watch import watch
from services import api
from services.client import Client
from services.spec import JobSpec


class RankKiller:
    """The demo's fault: SIGKILL one rank's trainer once the job passes a step."""

    def __init__(self, rank: int | None, at_step: int):
        self.rank, self.at_step, self.done = rank, at_step, False

    def __call__(self, j: api.JobStatus) -> None:
        if self.done or j.phase != "Running" or j.step < self.at_step:
            return
        ranks = sorted(j.mesh.ranks, key=lambda r: r.rank)
        if not ranks:
            return
        victim = ranks[self.rank if self.rank is not None else default_victim(len(ranks))]
        if victim.pid is None:
            return
        c = victim.coord
        print(
            f"\n>>> demo: SIGKILL rank {victim.rank} (dp={c.dp} pp={c.pp} tp={c.tp}) on worker "
            f"{victim.worker}, pid {victim.pid}, at step {j.step}",
            flush=True,
        )
        try:
            os.kill(victim.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # it just ended: try the next poll
        self.done = True


def default_victim(world: int) -> int:
    """The rank after the middle one (on a 3D mesh, away from rank 0's rendezvous host), or
    the last on a world of one or two."""
    return min(world // 2 + 1, world - 1)


def kill_step(spec: JobSpec, asked: int | None) -> int:
    """The step the demo kills a rank at: by default 40% of the run, and after a checkpoint
    so that the recovery resumes from one."""
    return asked or max(spec.checkpoint.every_steps + 2, int(spec.train.steps * 0.4))


def run_demo(
    stack: LocalStack,
    spec: JobSpec,
    spec_name: str,
    interval: float,
    kill_at: int | None,
    kill_rank: int | None,
    kill: bool = True,
) -> int:
    """Start `stack`, submit `spec`, kill a rank (unless not `kill`), watch to the end, print
    the job and its recoveries; the caller stops the stack."""
    print(
        f"meshkeeper demo: starting redis, a controller and {stack.cfg.workers} workers "
        f"(logs in {stack.logs})",
        flush=True,
    )
    stack.start()
    with Client(stack.url, stack.secrets.admin_token) as c:
        job = c.submit(spec.model_dump(mode="json"))
        at = kill_step(spec, kill_at)
        fault = f"a rank will be killed at step {at}" if kill else "no fault (--no-kill)"
        print(f"submitted {spec_name} as {job.id}; {fault}", flush=True)
        code = watch(c, job.id, interval, RankKiller(kill_rank, at) if kill else None)
        final = c.job(job.id)
        out = render.console()
        out.print(render.job_detail(final))
        for rec in final.recoveries:
            out.print(render.recovery(rec))
        return code
