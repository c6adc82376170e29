"""Silent data corruption (docs/architecture.md, "Silent data corruption"): one bit flipped in
one rank's gradient is found by the replicas' fingerprint check within sdc.every_steps and
blamed on that rank by the replay; one flipped in its parameters or optimizer state after the
update is found by its own state-at-rest check within the step, in any layout. Either way its
worker is quarantined, and the job rolls back to the newest checked snapshot and ends with the
loss curve of a run that was never corrupted."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import EVERY, assert_curve, mesh_spec, rank, start, stitched, succeeded

pytestmark = pytest.mark.slow

CHECK_EVERY = 4  # below the checkpoint interval (5): checks run at 4, 5, 8, 10, 12, 15


def blamed_and_replaced(stack, spec: dict, culprit_rank: int):
    """Run the job to Succeeded through exactly one recovery: a SilentDataCorruption fault on
    `culprit_rank`, whose worker is quarantined and replaced. (job, recovery, evidence,
    the culprit's worker)."""
    w, j = start(stack, spec)
    culprit = rank(j, culprit_rank).worker
    j = w.finish()
    succeeded(stack, j)
    [rec] = j.recoveries
    assert (rec.cause, rec.action) == ("SilentDataCorruption", "replace"), rec
    assert [q.worker for q in rec.quarantined] == [culprit], rec.quarantined
    [fault] = rec.faults
    assert (fault.rank, fault.worker) == (culprit_rank, culprit), fault
    return j, rec, fault.evidence, culprit


@pytest.mark.parametrize(
    "parallel, flip",
    [
        ({"dp": 2}, {"rank": 1, "step": 6, "tensor": "param"}),
        ({"dp": 2}, {"rank": 0, "step": 7, "tensor": "grad"}),
        ({"dp": 2}, {"rank": 1, "step": 8, "tensor": "optim"}),  # on a check step
        ({"dp": 2, "tp": 2}, {"rank": 3, "step": 6, "tensor": "param"}),
        ({"dp": 2, "tp": 2}, {"rank": 2, "step": 9, "tensor": "grad"}),
        ({"dp": 2, "tp": 2}, {"rank": 1, "step": 6, "tensor": "optim"}),
    ],
    ids=["dp2-param", "dp2-grad", "dp2-optim", "dp2tp2-param", "dp2tp2-grad", "dp2tp2-optim"],
)
def test_bit_flip_is_found_blamed_and_rolled_back_to_the_exact_loss(
    stack, uninterrupted, parallel, flip
):
    spec = mesh_spec(f"sdc-{flip['tensor']}", parallel={**parallel, "zero": 0})
    spec["sdc"] = {"every_steps": CHECK_EVERY}
    # bit 22, the mantissa's top bit: a silent change (an exponent flip would make the loss
    # non-finite, which fails loudly on its own)
    spec["chaos"] = {"bitflip": [{**flip, "bit": 22}]}
    want = uninterrupted(spec)  # the reference run never sees `chaos` (tests/launch.py)
    j, rec, ev, culprit = blamed_and_replaced(stack, spec, flip["rank"])
    assert ev["suspects"] == [flip["rank"]], ev
    checks = [s for s in range(1, j.steps + 1) if s % CHECK_EVERY == 0 or s % EVERY == 0]
    if flip["tensor"] == "grad":  # the update itself went wrong: the replicas' comparison
        assert flip["rank"] in ev["ranks"] and len(ev["ranks"]) == 2, ev  # rank and replica
        assert ev["step"] == min(s for s in checks if s >= flip["step"]), ev  # the next check
    else:  # state changed after the update wrote it: the rank's own check, before any copy
        assert (ev["check"], ev["ranks"], ev["step"]) == ("at_rest", [flip["rank"]], flip["step"])
    # rolled back to the replicas' check before the flip
    assert ev["clean_step"] == max(s for s in checks if s < flip["step"]), ev
    assert rec.resumed_step == ev["clean_step"], rec
    assert set(rec.restored_from.values()) <= {"memory", "peer"}, rec.restored_from
    assert rec.restored_from[str(flip["rank"])] == "peer", rec.restored_from  # not its own copy
    assert culprit not in {r.worker for r in j.mesh.ranks}
    assert_curve(stack, j, want, exact=True)


def test_compute_fault_is_caught_by_a_spot_check_and_blamed_without_a_rollback(
    stack, uninterrupted
):
    """zero 3 has no replicas: every CHECK_EVERY steps each rank re-executes one microbatch
    (worker/trainer/spot_check.py). A bit flipped in rank 1's first pass at step 8 makes its
    passes differ; the check changed no state, so the job resumes from step 8 itself. The
    reference run has the default sdc section (spot checks every 100 steps: none in 15), so
    the exact loss also shows that the checks touch nothing."""
    spec = mesh_spec("sdc-compute", parallel={"dp": 2, "zero": 3})
    spec["sdc"] = {"spot_every_steps": CHECK_EVERY}
    flip = {"rank": 1, "step": 2 * CHECK_EVERY, "tensor": "compute"}
    spec["chaos"] = {"bitflip": [flip]}
    want = uninterrupted(spec)
    j, rec, ev, _ = blamed_and_replaced(stack, spec, flip["rank"])
    assert (ev["ranks"], ev["suspects"]) == ([1], [1]), ev
    assert (ev["step"], ev["clean_step"], rec.resumed_step) == (flip["step"],) * 3, (ev, rec)
    assert "spot check" in ev["detail"], ev
    assert rec.restored_from[str(flip["rank"])] == "peer", rec.restored_from
    assert_curve(stack, j, want, exact=True)


def test_a_flip_at_rest_under_zero3_is_found_blamed_and_rolled_back_to_the_exact_loss(
    stack, uninterrupted
):
    """dp2 x tp2 at zero 3, the default: no replicas, and a spot check reads the state without
    checking it. Before the state-at-rest check, this flip (rank 1's parameter, after the
    update of step 12) was trained on and the job ended Succeeded at another loss. Now rank 1
    finds it before step 12's snapshot is taken, and the job resumes from step 11's."""
    spec = mesh_spec("sdc-at-rest", parallel={"dp": 2, "tp": 2, "zero": 3})
    flip = {"rank": 1, "step": 12, "tensor": "param", "bit": 22}
    spec["chaos"] = {"bitflip": [flip]}
    want = uninterrupted(spec)
    j, rec, ev, _ = blamed_and_replaced(stack, spec, flip["rank"])
    assert (ev["check"], ev["step"], ev["ranks"], ev["suspects"]) == ("at_rest", 12, [1], [1]), ev
    assert ev["clean_step"] == rec.resumed_step == 11, (ev, rec)
    assert rec.restored_from[str(flip["rank"])] == "peer", rec.restored_from
    assert_curve(stack, j, want, exact=True)


def test_a_flip_between_steps_is_found_by_its_rank_alone_and_its_peers_are_collateral(
    stack, uninterrupted
):
    """The flip lands after step 6's snapshot and checkpoint copies were verified and taken
    (`idle`). Rank 1's own check finds it when step 7 begins, with no collective: rank 1
    exits with the evidence, its peer fails in step 7's first collective, and only rank 1 is
    blamed. Step 6's copies were clean, so the job resumes from step 6 itself."""
    spec = mesh_spec("sdc-idle", parallel={"dp": 2, "zero": 3})
    flip = {"rank": 1, "step": 6, "tensor": "idle", "bit": 22}
    spec["chaos"] = {"bitflip": [flip]}
    want = uninterrupted(spec)
    j, rec, ev, _ = blamed_and_replaced(stack, spec, flip["rank"])
    assert (ev["check"], ev["step"], ev["ranks"], ev["suspects"]) == ("at_rest", 6, [1], [1]), ev
    assert ev["clean_step"] == rec.resumed_step == 6, (ev, rec)
    assert_curve(stack, j, want, exact=True)


def test_a_flip_under_a_nondeterministic_backward_is_blamed_by_distance_from_the_replay(
    stack, uninterrupted
):
    """`chaos.nondeterministic` makes every backward differ bitwise between executions, as a
    GPU's atomics do, so the replay reproduces neither replica's history and the bit-for-bit
    rule can blame nobody of two. Their distances from the replay are equal until step 7,
    where rank 0's gradient was flipped; there rank 0's lies far off and its replica's at the
    noise, so rank 0 alone is blamed and replaced. The losses match the deterministic run to
    the noise's size, not bit for bit."""
    spec = mesh_spec("sdc-noisy", parallel={"dp": 2, "zero": 0})
    spec["sdc"] = {"every_steps": CHECK_EVERY}
    flip = {"rank": 0, "step": 7, "tensor": "grad", "bit": 22}
    spec["chaos"] = {"bitflip": [flip], "nondeterministic": True}
    want = uninterrupted(spec)
    j, rec, ev, _ = blamed_and_replaced(stack, spec, flip["rank"])
    assert (ev["step"], ev["ranks"], ev["suspects"]) == (8, [0, 1], [0]), ev
    assert ev["clean_step"] == rec.resumed_step == 5, (ev, rec)  # step 5's checkpoint check
    apart = flip["step"] - ev["clean_step"]  # the replicas part at the flip's step, not before
    assert (
        f"distance from the replay ({apart} step(s) into the replay rank(s) [0] lay"
        in (ev["detail"])
    ), ev
    got = stitched(stack, j)
    far = [(s, got[s]["loss"], w["loss"]) for s, w in enumerate(want, 1)]
    assert all(abs(g - w) <= 1e-4 * abs(w) for _, g, w in far), far
    assert any(g != w for _, g, w in far), "the backward was not made nondeterministic"
