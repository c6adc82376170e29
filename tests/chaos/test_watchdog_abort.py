"""The NCCL watchdog's abort, on the shared stack (issue 12).

On NCCL, a rank that stops entering collectives leaves the others waiting in one until the
process group's timeout; then each waiting rank's watchdog aborts its own process (SIGABRT).
Here the fault is real and the abort is what the watchdog would do: one rank spins
forever between two collective phases (the trainer's chaos hook: it stops entering
collectives), the others block in their next one, and the test SIGABRTs every survivor.
The spinning rank must be blamed (`RankHung`, by its collective counters) and its worker
replaced; the aborted survivors are collateral: their workers keep their ranks in the next
generation.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.chaos.chaos import (
    DP_TP,
    assert_curve,
    at_step,
    completed,
    gone,
    mesh_spec,
    metrics_path,
    rank,
    start,
    succeeded,
    wait_record,
)
from tests.stack import wait_until
from worker.progress import counters_path, read_counters

pytestmark = pytest.mark.slow

STOP_AT = 8  # the hook fires at the next step boundary (of 15): past the first commit (5)
VICTIM = 3


def test_watchdog_aborted_survivors_are_collateral_and_the_stopped_rank_is_blamed(
    stack, uninterrupted
):
    spec = mesh_spec("watchdog-abort", parallel=DP_TP)  # three survivors in TP groups, one spare
    want = uninterrupted(spec)
    w, j1 = start(stack, spec)
    victim, spare = rank(j1, VICTIM), j1.mesh.spares[0]
    survivors = [r for r in j1.mesh.ranks if r.rank != VICTIM]
    files = {r.rank: counters_path(metrics_path(stack, j1, r.rank)) for r in j1.mesh.ranks}
    wait_record(
        metrics_path(stack, j1, VICTIM), at_step(STOP_AT), 120, f"rank {VICTIM} at {STOP_AT}"
    )
    try:
        # the trainer's chaos hook (worker/progress.py; the test stack's agents arm it): at its
        # next step boundary, outside every collective phase, the victim spins forever
        os.kill(victim.pid, signal.SIGUSR2)

        # the survivors blocked: the counters settled, some survivor past the spinning rank,
        # and the controller has seen them, as it would have before any watchdog fired
        last: dict[int, tuple] = {}  # rank -> (file counters, reported entered, left, state)

        def waiting() -> bool:
            before = {r: v[0] for r, v in last.items()}
            seen = {r.rank: r for r in w.poll().mesh.ranks}
            for r, f in files.items():
                s = seen[r]
                last[r] = (read_counters(f), s.coll_entered, s.coll_left, s.proc_state)
            victim_at = last[VICTIM][0]
            return (
                before == {r: v[0] for r, v in last.items()}
                and all(v[0] == v[1:3] for v in last.values())
                and victim_at[0] == victim_at[1]
                and max(last[r.rank][0][0] for r in survivors) > victim_at[0]
            )

        try:
            wait_until(waiting, 90, "the survivors blocked behind the spinning rank", every=1.0)
        except AssertionError as e:
            raise AssertionError(f"{e}; seen {last}") from None
        entered = last[VICTIM][0][0]
        for r in survivors:  # what each survivor's NCCL watchdog does at the timeout
            os.kill(r.pid, signal.SIGABRT)

        j = w.until(lambda j: j.generation >= 2, 60, "a recovery from the aborts")
        rec = j.recoveries[0]
        assert (rec.cause, rec.action) == ("RankHung", "replace"), rec
        assert [(f.rank, f.worker) for f in rec.faults] == [(VICTIM, victim.worker)], rec.faults
        detail = rec.faults[0].detail
        assert f"entered {entered} collective phases and left {entered}" in detail, detail
        # the aborts its agents had reported by the pass that decided: some survivors, or all
        aborted = re.search(r"aborted rank\(s\) \[([\d, ]+)\] \(SIGABRT\)", detail)
        assert aborted, detail
        assert {int(n) for n in aborted[1].split(",")} <= {r.rank for r in survivors}, detail
        assert rec.replaced == [{"old": victim.worker, "new": spare}], rec
        # the survivors are collateral: each keeps its rank on its worker, and only the
        # victim's worker is quarantined
        assert {r.rank: r.worker for r in j.mesh.ranks} == {
            **{r.rank: r.worker for r in survivors},
            VICTIM: spare,
        }
        assert [q.worker for q in rec.quarantined] == [victim.worker], rec.quarantined
        wait_until(lambda: gone(victim.pid), 30, f"the spinning trainer {victim.pid} to be killed")

        j = w.finish()
        succeeded(stack, j)
        assert [(r.cause, r.action) for r in j.recoveries] == [("RankHung", "replace")]
        assert (j.restarts, j.generation) == (1, 2)
        completed(j.recoveries[0])
        assert_curve(stack, j, want, exact=True)
    finally:
        if not gone(victim.pid):
            os.kill(victim.pid, signal.SIGKILL)
