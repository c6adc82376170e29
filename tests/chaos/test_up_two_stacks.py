"""Two `meshkeeper up` stacks on one host (issue 50): both name their workers w0, w1, ...,
and an agent frees every snapshot under its snapshot root that is not its own job's, so with
one root for both (as the default /dev/shm/meshkeeper/<worker id> was) each stack deleted the
other's in-memory snapshots. Each stack has a root of its own (cli/local_stack.py,
`snapshot_root`): a job on each, a trainer of each SIGKILLed mid-run, and both recover from
host memory with no `SnapshotFailed`, ending with the loss of an uninterrupted run."""

from __future__ import annotations

import pytest

from services.procs import free_port
from tests.chaos.chaos import (
    Watch,
    assert_curve,
    at_step,
    events,
    kill,
    metrics_path,
    paced_spec,
    rank,
    records,
    succeeded,
)
from tests.chaos.conftest import UP_WORKERS
from tests.chaos.test_chaos import hot_restore, only_recovery
from tests.chaos.upstack import UpStack
from tests.stack import wait_until

pytestmark = pytest.mark.slow

KILL_AT = 6  # of paced_spec's 40 steps of 0.25 s: past the first snapshots, far from the end


def test_two_ups_on_one_host_each_recover_from_their_own_host_memory(up, tmp_path, uninterrupted):
    b = UpStack(tmp_path / "run", free_port(), UP_WORKERS)
    try:
        b.wait_ready(UP_WORKERS)
        stacks = {"A": up, "B": b}
        spec = paced_spec("two-ups")  # dp2, a spare, snapshots in host memory every step
        want = uninterrupted(spec)
        # both jobs submitted before either is waited for: they train side by side
        watches = {n: Watch(s, s.client.submit(spec).id) for n, s in stacks.items()}
        firsts: dict = {}
        killed: set[str] = set()

        def kill_each_at_its_step() -> bool:
            """Each stack's rank 1 killed as soon as it reaches KILL_AT, whichever comes first:
            waiting for one stack before looking at the other let a loaded host's other job
            reach its last step before its kill (it then recovered into nothing to do)."""
            for n, s in stacks.items():
                if n not in firsts:
                    j = watches[n].poll()
                    if (
                        j.mesh.generation == 1
                        and j.mesh.ranks
                        and all(r.pid and r.state == "running" for r in j.mesh.ranks)
                    ):
                        firsts[n] = j
                elif n not in killed and any(
                    map(at_step(KILL_AT), records(metrics_path(s, firsts[n], 1)))
                ):
                    kill(rank(firsts[n], 1).pid)
                    killed.add(n)
            return len(killed) == len(stacks)

        wait_until(kill_each_at_its_step, 180, f"each stack's rank 1 to reach step {KILL_AT}")

        for n, s in stacks.items():
            j = watches[n].finish()
            succeeded(s, j)
            failed = [e.message for e in events(s, j.id) if e.reason == "SnapshotFailed"]
            assert not failed, f"stack {n}: {failed}"
            rec = only_recovery(j, "TrainerKilled", "replace")
            # rank 0 from its own host memory, rank 1 (moved to the spare) from rank 0's copy:
            # neither fell back to the disk checkpoint
            hot_restore(rec, moved=1, world=2)
            assert_curve(s, j, want, exact=True)
    finally:
        b.close()
