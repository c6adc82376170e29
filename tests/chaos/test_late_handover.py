"""A kept trainer that cannot take its order in time is replaced by a fresh process (issue 48,
worker/agent/agent.py `_take_over_late`): the in-place restart never leaves a recovery waiting
longer than HANDOVER_S on a survivor. Rank 1 is SIGKILLed; rank 0 survives, but stays in its
unwinding past the bound (`chaos.unwind_stall_s`, as a rank stuck in native code would, its
process running). Its agent hands it the order, and after the bound dumps its threads' stacks
into its log and starts the rank afresh; it restores from its snapshot in host memory, rank 1
from its buddy's copy on the spare, and the loss curve is an uninterrupted run's, bit for
bit."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import (
    assert_curve,
    at_step,
    completed,
    events,
    gone,
    kill,
    mesh_spec,
    metrics_path,
    rank,
    start,
    succeeded,
    wait_record,
)
from tests.chaos.test_chaos import KILL_AT
from worker.agent.agent import HANDOVER_S

pytestmark = pytest.mark.slow


def test_a_survivor_that_cannot_take_its_order_is_started_afresh_after_the_bound(
    stack, uninterrupted
):
    spec = mesh_spec("late-handover")  # one spare: rank 1 moves there, rank 0's worker stays
    want = uninterrupted(spec)
    spec["chaos"] = {"unwind_stall_s": HANDOVER_S + 20}
    w, j1 = start(stack, spec)
    stuck, victim = rank(j1, 0), rank(j1, 1)
    wait_record(metrics_path(stack, j1, 1), at_step(KILL_AT), 120, f"rank 1 at step {KILL_AT}")
    kill(victim.pid)
    j = w.until(
        lambda j: j.recoveries and j.recoveries[0].completed_at is not None,
        180,
        "the recovery from the kill to complete",
    )
    rec = j.recoveries[0]
    assert (rec.cause, rec.action) == ("TrainerKilled", "replace"), rec
    assert [f.rank for f in rec.faults] == [1], rec.faults
    completed(rec)
    kept = [e.message for e in events(stack, j1.id) if e.reason == "TrainerKept"]
    assert len(kept) == 1 and f"(pids [{stuck.pid}])" in kept[0], kept
    late = [e.message for e in events(stack, j1.id) if e.reason == "TrainerNotKept"]
    assert len(late) == 1 and f"rank 0 (pid {stuck.pid})" in late[0], late
    assert f"did not within {HANDOVER_S:.0f}s (process state S;" in late[0], late
    old_log = metrics_path(stack, j1, 0).with_name("rank0.log")
    assert str(old_log) in late[0], late
    # where it was stuck: faulthandler's dump of every thread, the stall's frame among them
    assert "most recent call first" in old_log.read_text() and "in attempt" in (old_log.read_text())
    # the world met once the fresh process started: after the bound, and not long after it
    assert HANDOVER_S <= rec.durations["rendezvous_s"] < HANDOVER_S + 30, rec.durations
    assert rec.restored_from == {"0": "memory", "1": "peer"}, rec
    pids = {r.rank: r.pid for r in j.mesh.ranks}
    assert pids[0] != stuck.pid and pids[1] != victim.pid, pids
    assert gone(stuck.pid) and gone(victim.pid)
    j = w.finish()
    succeeded(stack, j)
    assert len(j.recoveries) == 1, j.recoveries
    assert_curve(stack, j, want, exact=True)
