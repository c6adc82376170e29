"""Exact blame under real faults, on the shared stack (issue 10).

- A rank caught in a pure-Python busy loop (state R, between two collectives): its peer waits
  inside the next collective, every step is frozen, and the collective counters name the
  spinning rank. The fault is real: the trainer's SIGUSR2 handler (worker/progress.py), armed
  only in trainers of an agent started with MESHKEEPER_CHAOS_HOOKS=1 (as the test stack's
  agents are, tests/stack.py), makes it spin forever at its next step boundary. That worker is
  replaced, quarantined, and re-admitted only after its health probe passed.
- A trainer whose allocator runs out of memory (`chaos.device_oom`: a request for more bytes
  than the host has, the CPU allocator's real error): it exits with code 5 and the job fails
  with OutOfMemory naming the planner's estimate and the fix; no spare is spent.
- A trainer killed by the kernel OOM killer: the spec's `chaos.memory_limit` has rank 1's agent
  start it in a memory cgroup of its own whose limit its model cannot fit in; the job fails
  with OutOfMemory naming the rank and its peak memory, and no spare is spent.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.chaos.chaos import (
    Watch,
    assert_curve,
    at_step,
    completed,
    events,
    free_pool,
    gone,
    mesh_spec,
    metrics_path,
    start,
    succeeded,
    wait_record,
)
from tests.stack import tiny_spec, wait_until
from worker.agent.memory_watch import memory_cgroup
from worker.progress import counters_path, read_counters

pytestmark = pytest.mark.slow

SPIN_AT = 8


def proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_busy_looping_rank_is_blamed_quarantined_and_probed_back(stack, uninterrupted):
    # quarantined for 5 s: long enough to be seen out of the pool right after the recovery
    # (checked at once below), short enough to be over when the job ends
    spec = mesh_spec("blame-spin", parallel={"dp": 2}, hang_after_s=6, quarantine_s=5)
    want = uninterrupted(spec)
    target = free_pool(stack)[1]  # placement takes the free pool in order: rank 1 lands here
    w, j1 = start(stack, spec)
    victim = next(r for r in j1.mesh.ranks if r.worker == target)
    peer = next(r for r in j1.mesh.ranks if r.worker != target)
    spare = j1.mesh.spares[0]
    wait_record(
        metrics_path(stack, j1, victim.rank),
        at_step(SPIN_AT),
        120,
        f"rank {victim.rank} at step {SPIN_AT}",
    )
    os.kill(victim.pid, signal.SIGUSR2)
    # the fault as injected: the victim spins on a CPU outside any collective, its peer
    # sleeps inside one it entered after the victim's last
    vc = counters_path(metrics_path(stack, j1, victim.rank))
    pc = counters_path(metrics_path(stack, j1, peer.rank))
    # the same counts one second apart: a rank merely computing between two collectives
    # also looks like this for an instant (the SIGUSR2 hook fires at its next step)
    seen: list[tuple] = []

    def spinning() -> bool:
        now = (read_counters(vc), read_counters(pc))
        settled = bool(seen) and seen[-1] == now
        seen.append(now)
        return (
            settled
            and proc_state(victim.pid) == "R"
            and now[1][0] > now[0][0]
            and now[0][0] == now[0][1]
        )

    wait_until(spinning, 30, "the victim spinning (R) behind its peer's collective count", 1.0)
    entered_v, entered_p = seen[-1][0][0], seen[-1][1][0]

    j = w.until(lambda j: j.generation >= 2, 120, "a recovery from the hang")
    rec = j.recoveries[0]
    assert (rec.cause, rec.action) == ("RankHung", "replace"), rec
    assert [(f.rank, f.worker) for f in rec.faults] == [(victim.rank, target)], rec.faults
    detail = rec.faults[0].detail
    assert (
        "the others wait on it" in detail and f"entered {entered_v} collective phases" in detail
    ), detail
    assert f"collective phase {entered_p}" in detail, detail
    assert rec.replaced == [{"old": target, "new": spare}], rec
    # quarantined: recorded in Redis, announced, and out of the scheduler's free pool
    health = stack.store.r.hgetall(f"mk:worker:{target}:health")
    assert (
        health.get("cause") == "RankHung" and float(health["quarantined_until"]) > rec.fault_at
    ), health
    assert [q.worker for q in rec.quarantined] == [target], rec.quarantined
    assert any(e.reason == "WorkerQuarantined" and target in e.message for e in events(stack, j.id))
    assert target not in free_pool(stack)
    wait_until(lambda: gone(victim.pid), 30, f"the spinning trainer {victim.pid} to be stopped")

    j = w.finish()
    succeeded(stack, j)
    assert [(r.cause, r.action) for r in j.recoveries] == [("RankHung", "replace")]
    assert (j.restarts, j.generation) == (1, 2)
    completed(j.recoveries[0])
    assert target not in {r.worker for r in j.mesh.ranks}
    assert_curve(stack, j, want, exact=True)

    # back in the pool only after the quarantine ended and the probe passed
    until = float(health["quarantined_until"])
    wait_until(lambda: target in free_pool(stack), 90, f"{target} re-admitted after its probe")
    probe = stack.store.r.hgetall(f"mk:worker:{target}:probe")
    assert probe.get("passed") == "1" and float(probe["at"]) >= until, probe
    assert "matmul and gloo all-reduce ok" in probe.get("detail", ""), probe


# -- OOM ------------------------------------------------------------------------------------
# A rank's model alone is ~70 MiB of fp32 parameters (half a rank's under zero 3) before
# gradients, Adam state and the gathered weights: far over the limit.
LIMIT_MIB = 64


def failed_out_of_memory(stack, spec: dict) -> tuple:
    """Run the job to its end: it must fail with OutOfMemory at once, in its first generation,
    with no recovery and its spare unspent (a spare has the same memory). (job, message)"""
    j = Watch(stack, stack.client.submit(spec).id).finish(180)
    assert j.phase == "Failed", (j.phase, [(c.type, c.reason, c.message) for c in j.conditions])
    failed = j.condition("Failed")
    assert failed.reason == "OutOfMemory", failed
    assert (j.restarts, j.generation, j.recoveries) == (0, 1, []), j.recoveries
    assert not {"RecoveryStarted", "ReplacingRank"} & {e.reason for e in events(stack, j.id)}
    assert j.mesh.spares and not (set(j.mesh.spares) & {r.worker for r in j.mesh.ranks})
    return j, failed.message


def test_oom_killed_trainer_fails_the_job_without_spending_a_spare(stack):
    spec = tiny_spec(
        "blame-oom",
        model={
            "preset": None,
            "layers": 2,
            "d_model": 256,
            "heads": 4,
            "vocab": 32768,
            "seq_len": 32,
        },
        parallel={"dp": 2},
        train={"steps": 20},
        fault_tolerance={"spares": 1, "dead_after_s": 2.0, "hang_after_s": 60},
        chaos={"memory_limit": [{"rank": 1, "mib": LIMIT_MIB}]},
    )
    j, msg = failed_out_of_memory(stack, spec)
    assert msg.startswith("rank 1 "), msg
    victim = next(r for r in j.mesh.ranks if r.rank == 1)
    assert f"worker {victim.worker}" in msg and "OOM killer" in msg, msg
    assert "peak memory (RSS) " in msg and "unknown" not in msg, msg
    assert f"memory cgroup limit {LIMIT_MIB} MiB" in msg and "zero 3" in msg, msg
    assert victim.exit_code == -9, victim
    # the agent removes the group it made once the rank is gone: nothing left on the host
    parent, _ = memory_cgroup(stack.agents[victim.worker].pid)
    wait_until(lambda: not list(parent.glob(f"meshkeeper-*-{j.id}-*")), 30, "the group removed")


def test_allocator_out_of_memory_fails_the_job_with_the_plan_and_no_spare_spent(stack):
    spec = mesh_spec("blame-alloc-oom", steps=20)
    spec["chaos"] = {"device_oom": [{"rank": 1, "step": 3}]}
    j, msg = failed_out_of_memory(stack, spec)
    assert msg.startswith("rank 1 exited with code 5 (out of memory): "), msg
    assert "can't allocate memory" in msg, msg  # the allocator's own words
    assert "the planner's estimate for dp=2 pp=1 tp=1 zero=3: " in msg, msg
    assert "GiB per rank" in msg and "parallel.zero 3" in msg, msg
