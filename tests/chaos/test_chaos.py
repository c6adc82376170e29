"""Chaos: real processes are killed, stopped and slowed under a running job; every assertion
reads the REST status (and the events), and the trainers' own metrics files for the losses.

For each scenario: the job reaches Succeeded, the stitched loss curve (rank 0's records,
newest generation per step) has every step exactly once per generation with no gap, and it
equals an uninterrupted standalone run of the same spec: bit for bit on an unchanged mesh,
rtol 1e-5 after a reshape. Scenarios about one rank or one worker run dp2; those whose subject
needs tensor parallelism run dp2 x tp2 (`DP_TP`, tests/chaos/chaos.py).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.chaos.chaos import (
    DP_TP,
    EVERY,
    Hogs,
    assert_curve,
    assert_run_record,
    at_step,
    completed,
    deprioritize,
    disk_only,
    events,
    gone,
    kill,
    mesh_spec,
    metrics_path,
    pin,
    pool_cut_to,
    rank,
    records,
    start,
    succeeded,
    wait_record,
)
from tests.stack import process_groups_alive, tiny_spec, wait_until

pytestmark = pytest.mark.slow

KILL_AT = 8  # steps into generation 1 (of 15): past the first commit, before the second


def only_recovery(j, cause: str, action: str):
    assert [(r.cause, r.action) for r in j.recoveries] == [(cause, action)], j.recoveries
    assert (j.restarts, j.generation) == (1, 2), (j.restarts, j.generation)
    return j.recoveries[0]


def same_coordinates(before, after, moved: dict[str, str]) -> None:
    """Every rank kept its coordinate; only the moved workers' ranks changed worker."""
    for r in before.mesh.ranks:
        a = rank(after, r.rank)
        assert a.coord == r.coord
        assert a.worker == moved.get(r.worker, r.worker), (r.rank, r.worker, a.worker, moved)


def hot_restore(rec, moved: int, world: int) -> None:
    """Every survivor restored from its own host memory, the moved rank from its buddy's
    copy, and at most one step was redone (docs/architecture.md, "Hot recovery")."""
    want = {str(r): "peer" if r == moved else "memory" for r in range(world)}
    assert rec.restored_from == want, rec
    assert rec.steps_lost <= 1, rec


def reasons(stack, jid) -> list[str]:
    return [e.reason for e in events(stack, jid)]


# -- 1 ------------------------------------------------------------------------------------
def test_sigkill_one_trainer(stack, uninterrupted):
    """dp2 x tp2: the moved rank's TP shard comes back from its buddy's copy."""
    spec = mesh_spec("chaos-trainer", parallel=DP_TP)
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    victim, spare = rank(j1, 1), j1.mesh.spares[0]
    wait_record(metrics_path(stack, j1, 1), at_step(KILL_AT), 120, f"rank 1 at step {KILL_AT}")
    kill(victim.pid)
    j = w.finish()
    succeeded(stack, j)
    rec = only_recovery(j, "TrainerKilled", "replace")
    assert [(f.rank, f.worker) for f in rec.faults] == [(1, victim.worker)], rec.faults
    assert "signal 9" in rec.faults[0].detail
    assert rec.replaced == [{"old": victim.worker, "new": spare}]
    assert rec.to_shape == [2, 1, 2]
    completed(rec)
    hot_restore(rec, moved=1, world=4)
    same_coordinates(j1, j, {victim.worker: spare})
    assert victim.worker in j.mesh.spares  # its agent lives: it stays with the job as a spare
    assert {"RecoveryStarted", "Recovered"} <= set(reasons(stack, j.id))
    curve = assert_curve(stack, j, want, exact=True)
    assert curve[rec.resumed_step + 1]["generation"] == 2  # the first step after the restore


# -- 2 ------------------------------------------------------------------------------------
def test_sigkill_worker_agent_and_trainers(stack, uninterrupted):
    spec = mesh_spec("chaos-worker")
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    victim, spare = rank(j1, 1), j1.mesh.spares[0]
    wait_record(metrics_path(stack, j1, 1), at_step(KILL_AT), 120, f"rank 1 at step {KILL_AT}")
    stack.kill_worker(victim.worker, [victim.pid])
    j = w.finish()
    succeeded(stack, j)
    rec = only_recovery(j, "WorkerDead", "replace")
    assert victim.worker in {f.worker for f in rec.faults}
    assert {f.cause for f in rec.faults} == {"WorkerDead"}, rec.faults
    assert rec.replaced == [{"old": victim.worker, "new": spare}]
    completed(rec)
    # the whole worker is gone: the rank restores from its buddy's copy, never from the dead
    # worker's files (test_hot_recovery.py kills a host of its own, memory and all)
    hot_restore(rec, moved=1, world=2)
    same_coordinates(j1, j, {victim.worker: spare})
    assert victim.worker not in j.mesh.spares
    assert gone(victim.pid)
    assert_curve(stack, j, want, exact=True)


# -- 3 ------------------------------------------------------------------------------------
def test_sigkill_rendezvous_host(stack, uninterrupted):
    spec = mesh_spec("chaos-rdzv")
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    host, spare = rank(j1, 0), j1.mesh.spares[0]
    wait_record(metrics_path(stack, j1, 0), at_step(KILL_AT), 120, f"rank 0 at step {KILL_AT}")
    stack.kill_worker(host.worker, [host.pid])
    j = w.finish()
    succeeded(stack, j)
    rec = only_recovery(j, "WorkerDead", "replace")
    assert rec.replaced == [{"old": host.worker, "new": spare}]
    completed(rec)
    same_coordinates(j1, j, {host.worker: spare})
    assert rank(j, 0).worker == spare
    assert j.mesh.rendezvous != j1.mesh.rendezvous, (j1.mesh.rendezvous, j.mesh.rendezvous)
    assert j.mesh.rendezvous.rsplit(":", 1)[1] != j1.mesh.rendezvous.rsplit(":", 1)[1]
    assert_curve(stack, j, want, exact=True)
    # rank 0's curves stay whole across its move, and the record says where it took up the run
    at = rec.resumed_step
    note = f"generation {j.generation} resumed after step {at} from host memory (peer"
    assert_run_record(stack, j, spec, want, [(at, note)])


# -- 4 --------------------------------------------------------------------------------------
def test_sigstop_hung_rank_is_replaced_and_fenced_after_sigcont(stack, uninterrupted):
    spec = mesh_spec("chaos-hang", hang_after_s=6)
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    victim, spare = rank(j1, 1), j1.mesh.spares[0]
    wait_record(metrics_path(stack, j1, 1), at_step(KILL_AT), 120, f"rank 1 at step {KILL_AT}")
    kill(victim.pid, signal.SIGSTOP)
    try:
        j = w.until(lambda j: j.generation >= 2, 120, "a recovery from the hang")
        rec = j.recoveries[0]
        assert (rec.cause, rec.action) == ("RankHung", "replace"), rec
        assert [(f.rank, f.worker) for f in rec.faults] == [(1, victim.worker)], rec.faults
        assert rec.replaced == [{"old": victim.worker, "new": spare}], rec
    finally:
        if not gone(victim.pid):
            kill(victim.pid, signal.SIGCONT)
    # resumed, the old process can write nothing into the new world: it is stopped by its agent
    wait_until(lambda: gone(victim.pid), 30, f"the stopped trainer {victim.pid} to be gone")
    j = w.finish()
    succeeded(stack, j)
    rec = only_recovery(j, "RankHung", "replace")
    completed(rec)
    same_coordinates(j1, j, {victim.worker: spare})
    assert j.last_checkpoint.generation == 2
    assert_curve(stack, j, want, exact=True)


def test_sigstopped_worker_is_replaced_and_fenced_after_sigcont(stack, uninterrupted):
    """The whole worker hosting rank 0 freezes (agent and trainer: a partitioned or paused
    node): its heartbeats stop, a spare takes its place. Then it resumes while generation 2
    trains, a generation-1 zombie: its agent finds its assignment withdrawn and its old
    trainer goes, and it writes to Redis what it saw: progress for generation 1. The new world
    ignores those writes: generation 2's ranks, the restart count and the checkpoint pointer
    (which rank 0's agent, the zombie's, used to move) are as if it had never woken up."""
    spec = disk_only(mesh_spec("chaos-pause"))  # the pointer's fencing, below
    spec["checkpoint"]["keep"] = 20  # every pointer stays in the history checked below
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    host, spare = rank(j1, 0), j1.mesh.spares[0]
    agent = stack.agents[host.worker]
    # frozen once generation 1 moved the pointer: the agent frozen here is the one that moves
    # it, and a commit still held in it would never land (a dp2 step can outrun the commit)
    w.until(lambda j: j.last_checkpoint, 60, "generation 1's first committed checkpoint")
    groups = [agent.pid, host.pid]
    for g in groups:
        os.killpg(g, signal.SIGSTOP)
    try:
        j = w.until(
            lambda j: j.recoveries and j.recoveries[0].completed_at,
            120,
            "generation 2 to train without the paused worker",
        )
    finally:
        resumed_at = time.time()
        for g in groups:
            os.killpg(g, signal.SIGCONT)
    rec = j.recoveries[0]
    assert (rec.cause, rec.action) == ("WorkerDead", "replace"), rec
    assert rec.replaced == [{"old": host.worker, "new": spare}]
    wait_until(lambda: gone(host.pid), 30, f"the resumed old trainer {host.pid} to be gone")
    assert agent.alive()

    # the zombie wrote: its report of generation 1's ranks, after it resumed ...
    def zombie_report():
        p = stack.store.progress([host.worker])[host.worker]
        return p if p.get("job") == j.id and float(p.get("updated_at") or 0) > resumed_at else None

    report = wait_until(zombie_report, 30, f"{host.worker}'s report after it resumed")
    assert report["generation"] == "1", report
    # ... and generation 2 did not take it in: same ranks on the same workers, none stopped
    now = w.poll()
    assert (now.generation, now.restarts) == (2, 1), (now.generation, now.restarts)
    assert {(r.rank, r.worker) for r in now.mesh.ranks} == {
        (r.rank, r.worker) for r in j.mesh.ranks
    }
    assert not [r for r in now.mesh.ranks if r.state in ("failed", "stopped", "lost")], (
        now.mesh.ranks
    )

    j = w.finish()
    succeeded(stack, j)
    only_recovery(j, "WorkerDead", "replace")
    same_coordinates(j1, j, {host.worker: spare})
    assert host.worker not in {r.worker for r in j.mesh.ranks} | set(j.mesh.spares)
    # no generation-1 pointer after the freeze: generation 1's newest one is where generation 2
    # resumed, and every later pointer is generation 2's (the history is newest first)
    history = stack.store.checkpoint_history(j.id)
    assert [h["generation"] for h in history] == sorted(
        (h["generation"] for h in history), reverse=True
    ), history
    assert max(h["step"] for h in history if h["generation"] == 1) == rec.resumed_step, history
    assert j.last_checkpoint.generation == j.generation == 2
    assert_curve(stack, j, want, exact=True)
    wait_until(lambda: host.worker in stack.idle_workers(), 30, f"{host.worker} idle again")


# -- 5 --------------------------------------------------------------------------------------
def test_cpu_contention_straggler_is_replaced(stack, uninterrupted):
    """dp=3, so the median is a healthy rank. The healthy ranks share one CPU; the victim has
    the other, with two busy loops that outweigh it (its session runs at nice 10): its compute
    time (on CPU plus queued for it) grows ~20x. Plain equal-weight hogs are not enough on a
    shared host: the foreign load they push onto the healthy ranks' CPU slows those ~3x too
    (seen), and with dp=2 the median is the mean of victim and healthy rank."""
    # 25 steps: the straggler window (6 steps) fills after the pinning, with steps to spare
    spec = mesh_spec(
        "chaos-slow",
        steps=25,
        parallel={"dp": 3},
        train={"global_batch": 24},
        straggler={"slowdown": 1.5, "window_steps": 6, "action": "replace"},
    )
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    victim, spare = rank(j1, 1), j1.mesh.spares[0]
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, "needs two CPUs: one for the healthy ranks, one for the victim"
    survivors = [r.pid for r in j1.mesh.ranks if r.rank != victim.rank]
    for pid in survivors:
        pin(pid, {cpus[0]})
    hogs = Hogs(cpus[1], 2)
    try:
        pin(victim.pid, {cpus[1]})
        deprioritize(victim.pid, 10)
        # The contention ends the moment the victim's process does: polled here, not through
        # the starved REST API, so the next generation's window fills on an even host. Left
        # on, the survivors sharing one CPU while the spare had the other (or the hogs' CPU)
        # made a survivor look slow in generation 2 (seen once in CI).
        wait_until(lambda: gone(victim.pid), 180, "the straggler's process to be stopped", 0.02)
    finally:
        hogs.stop()
        for pid in survivors:
            pin(pid, set(cpus))
    j = w.finish()
    succeeded(stack, j)
    rec = only_recovery(j, "Straggler", "replace")
    assert [(f.rank, f.worker) for f in rec.faults] == [(1, victim.worker)], rec.faults
    assert rec.replaced == [{"old": victim.worker, "new": spare}]
    completed(rec)
    same_coordinates(j1, j, {victim.worker: spare})
    flagged = [e.message for e in events(stack, j.id) if e.reason == "StragglerDetected"]
    assert not flagged, flagged  # no healthy rank reported either
    assert_curve(stack, j, want, exact=True)


# -- 6 --------------------------------------------------------------------------------------
def test_two_ranks_killed_at_once_with_one_spare(stack, uninterrupted):
    """Both exits usually land in one controller pass: one recovery, the job's spare and an
    idle pool worker promoted. When the agents report a pass apart, the first recovery already
    started the next generation; the other killed rank's worker (its agent alive) then just
    trains in it. Either way: one recovery, every blamed worker replaced, nothing else moved."""
    spec = mesh_spec("chaos-two", parallel=DP_TP)  # ranks 1 and 2: one in each DP replica
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    a, b, spare = rank(j1, 1), rank(j1, 2), j1.mesh.spares[0]
    wait_record(metrics_path(stack, j1, 1), at_step(KILL_AT), 120, f"rank 1 at step {KILL_AT}")
    kill(a.pid)
    kill(b.pid)
    j = w.finish()
    succeeded(stack, j)
    rec = only_recovery(j, "TrainerKilled", "replace")
    blamed = {f.worker for f in rec.faults}
    assert {f.cause for f in rec.faults} == {"TrainerKilled"} and blamed <= {a.worker, b.worker}, (
        rec.faults
    )
    moved = {m["old"]: m["new"] for m in rec.replaced}
    assert set(moved) == blamed, (rec.replaced, rec.faults)
    assert spare in moved.values()  # the job's spare first, then an idle pool worker
    assert len(set(moved.values())) == len(moved)
    assert not set(moved.values()) & {r.worker for r in j1.mesh.ranks}
    completed(rec)
    same_coordinates(j1, j, moved)
    assert gone(a.pid) and gone(b.pid)
    assert_curve(stack, j, want, exact=True)


# -- 7 ------------------------------------------------------------------------------------
def test_sigkill_during_checkpoint_save(stack, uninterrupted):
    """Rank 1 dies while the async save of checkpoint 10 is in flight: it is frozen right
    after its step-10 record (the save starts after it), checked to have left that save
    incomplete, then killed. Checkpoint 10 can never commit without it: the job resumes at 5."""
    spec = disk_only(mesh_spec("chaos-save"))  # a torn disk checkpoint is what this is about
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    victim = rank(j1, 1)
    path = metrics_path(stack, j1, 1)
    save = 2 * EVERY
    wait_record(path, at_step(save), 120, f"rank 1 at step {save}")
    kill(victim.pid, signal.SIGSTOP)  # what it has written now is all it will ever write
    time.sleep(0.5)  # time for the other ranks to finish the save, were it not waiting on rank 1
    shards = stack.checkpoint_dir(j1.id, spec) / "g000001" / f"step-{save:08d}"
    assert not (shards / ".metadata").exists(), (
        f"precondition: the save of step {save} had completed when rank 1 was frozen"
    )
    kill(victim.pid)
    own = records(path)
    assert not [r for r in own if r.get("event") == "checkpoint" and r["step"] == save], own
    assert max(r["step"] for r in own if "step" in r and "event" not in r) == save
    j = w.finish()
    succeeded(stack, j)
    rec = only_recovery(j, "TrainerKilled", "replace")
    completed(rec)
    assert rec.resumed_step == EVERY, rec  # the last committed checkpoint, never a torn one
    assert_curve(stack, j, want, exact=True)


# -- 8 ------------------------------------------------------------------------------------
def test_controller_killed_during_recovery(stack, uninterrupted):
    spec = mesh_spec("chaos-ctl")
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    victim = rank(j1, 1)
    wait_record(metrics_path(stack, j1, 1), at_step(KILL_AT), 120, f"rank 1 at step {KILL_AT}")
    kill(victim.pid)
    mid = w.until(
        lambda j: j.restarts >= 1 or j.phase == "Recovering",
        60,
        "the recovery to start",
        every=0.02,
    )
    old = stack.controller
    old.proc.kill(signal.SIGKILL)
    assert not old.proc.alive()
    stack.use(stack.start_controller())
    j = w.finish()
    succeeded(stack, j)
    rec = only_recovery(j, "TrainerKilled", "replace")
    completed(rec)
    assert mid.recoveries and mid.recoveries[0].completed_at is None, (
        "killed after the recovery ended"
    )
    sources = {e.source for e in events(stack, j.id) if e.reason == "Recovered"}
    assert sources and not any(f"-{old.proc.pid}-" in s for s in sources), sources
    assert_curve(stack, j, want, exact=True)


# -- 9 ------------------------------------------------------------------------------------
def test_no_spare_dp_shrinks_then_grows_back(stack, uninterrupted):
    """No spare and no idle worker: a dead worker's dp replica is dropped (its tp partner kept
    as the job's spare), and when the worker returns the job grows back at the next checkpoint.
    The pool is cut to the job's 4 workers by freezing the other agents (hosts gone silent):
    4 ranks show the behaviour as well as a job filling all 8 workers, at half the CPU."""
    # 25 steps: checkpoints still to come after the worker returns (the grow resumes at one)
    spec = mesh_spec("chaos-shrink", steps=25, parallel=DP_TP, spares=0)
    want = uninterrupted(spec)
    with pool_cut_to(stack, 4):
        w, j1 = start(stack, spec)
        assert len({r.worker for r in j1.mesh.ranks}) == 4 and not j1.mesh.spares
        victim = rank(j1, 3)  # dp=1, tp=1
        # early, so that however fast the steps, the shrunk job still has checkpoints to come
        # after the worker returns (it returns as soon as the shrink is decided)
        wait_record(
            metrics_path(stack, j1, 3), at_step(EVERY + 1), 180, f"rank 3 at step {EVERY + 1}"
        )
        # committed, not only saved: an async save still in flight at the kill commits nothing
        w.until(lambda j: j.last_checkpoint, 60, "a committed checkpoint")
        stack.kill_worker(victim.worker, [victim.pid])
        shrunk = w.until(
            lambda j: j.generation >= 2 and j.mesh.shape.dp == 1, 120, "dp to shrink to 1"
        )
        rec = shrunk.recoveries[0]
        assert (rec.cause, rec.action, rec.to_shape) == ("WorkerDead", "shrink", [1, 1, 2]), rec
        assert victim.worker not in {r.worker for r in shrunk.mesh.ranks}
        assert shrunk.condition("Recovering").reason in ("ShrinkingDP", "Recovered")
        returned_at = w.poll().last_checkpoint.step
        stack.restart_agent(victim.worker)
        j = w.finish(400)
    succeeded(stack, j)
    assert [(r.cause, r.action) for r in j.recoveries] == [
        ("WorkerDead", "shrink"),
        ("CapacityReturned", "grow"),
    ]
    assert j.restarts == 1 and j.generation == 3  # the grow is planned: not a restart
    grow = j.recoveries[1]
    assert grow.to_shape == [2, 1, 2] and j.mesh.shape.dp == 2
    for r in j.recoveries:
        completed(r)
    # at the first checkpoint committed after the worker came back (both of the dropped
    # replica's workers train again: the returned one and its partner, kept as a spare)
    assert grow.resumed_step > returned_at, (grow, returned_at)
    assert {r.worker for r in j.mesh.ranks} == {r.worker for r in j1.mesh.ranks}
    assert len(j.mesh.ranks) == 4
    assert_curve(stack, j, want, exact=False)


# -- 9b -----------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["pp", "tp"])
def test_no_spare_and_dp_at_min_dp_replans_then_returns_to_the_submitted_layout(
    stack, uninterrupted, split
):
    """dp2 x pp2 (or x tp2) with min_dp 2, no spare and no idle worker: a dead worker's
    replica cannot be dropped, so the controller re-plans (controller/replan.py) instead of
    waiting: dp2 on the three healthy workers, the third kept as the job's spare. The job
    resumes from its checkpoint resharded to the new mesh. When the worker returns, the job
    goes back to the submitted layout at its next checkpoint commit (a planned grow, reason
    RestoringLayout), and finishes with the loss curve of an uninterrupted run (rtol 1e-5:
    other meshes)."""
    # 25 steps: checkpoints still to come after the worker returns (the return resumes at one)
    spec = mesh_spec(
        f"chaos-replan-{split}",
        steps=25,
        parallel={"dp": 2, split: 2, "microbatches": 2},
        spares=0,
        min_dp=2,
    )
    submitted = [2, 2, 1] if split == "pp" else [2, 1, 2]
    want = uninterrupted(spec)
    with pool_cut_to(stack, 4):
        w, j1 = start(stack, spec)
        victim = rank(j1, 3)  # dp=1, and the second stage or shard
        wait_record(metrics_path(stack, j1, 3), at_step(EVERY + 1), 180, "rank 3 past a commit")
        w.until(lambda j: j.last_checkpoint, 60, "a committed checkpoint")
        stack.kill_worker(victim.worker, [victim.pid])
        replanned = w.until(
            lambda j: j.generation >= 2 and len(j.mesh.ranks) == 2, 120, f"a re-plan to {split} 1"
        )
        healthy = {r.worker for r in j1.mesh.ranks} - {victim.worker}
        assert {r.worker for r in replanned.mesh.ranks} | set(replanned.mesh.spares) == healthy
        assert len(replanned.mesh.ranks) == 2
        returned_at = w.poll().last_checkpoint.step
        stack.restart_agent(victim.worker)
        j = w.finish(400)
    succeeded(stack, j)
    plan, back = j.recoveries
    assert (plan.cause, plan.action, plan.to_shape) == ("WorkerDead", "replan", [2, 1, 1]), plan
    assert (back.cause, back.action, back.to_shape) == ("CapacityReturned", "grow", submitted)
    for r in j.recoveries:
        completed(r)
    assert back.resumed_step > returned_at, (back, returned_at)
    started = [e.message for e in events(stack, j.id) if e.reason == "RecoveryStarted"]
    assert "re-planned to dp=2 pp=1 tp=1" in started[0], started
    assert "RestoringLayout" in reasons(stack, j.id)
    assert j.restarts == 1  # the return is planned: not a restart
    assert [j.mesh.shape.dp, j.mesh.shape.pp, j.mesh.shape.tp] == submitted
    assert {r.worker for r in j.mesh.ranks} == {r.worker for r in j1.mesh.ranks}
    assert_curve(stack, j, want, exact=False)


# -- max_restarts ---------------------------------------------------------------------------
def test_max_restarts_zero_fails_on_first_fault(stack):
    spec = tiny_spec(
        "chaos-max", train={"steps": 200}, fault_tolerance={"spares": 1, "max_restarts": 0}
    )
    w, j1 = start(stack, spec)
    victim = rank(j1, 1)
    wait_record(metrics_path(stack, j1, 1), at_step(2), 120, "rank 1 at step 2")
    kill(victim.pid)
    j = w.finish(60)
    assert j.phase == "Failed"
    failed = j.condition("Failed")
    assert (failed.status, failed.reason) == ("True", "ReachedMaxRestarts"), failed
    assert "max_restarts is 0" in failed.message
    assert j.generation == 1
    assert "ReachedMaxRestarts" in reasons(stack, j.id)
    pids = [r.pid for r in j1.mesh.ranks]
    wait_until(lambda: not process_groups_alive(pids), 20, "every trainer of the job to stop")
