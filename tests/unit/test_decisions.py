"""The pure parts of fault handling (controller/faults.py, controller/quarantine.py): the
recovery record, its completion with each phase's duration, the wait-for-capacity decision,
and who is quarantined."""

from __future__ import annotations

from controller import faults
from controller.decisions import Complete, WaitForCapacity
from controller.jobs import Job
from controller.quarantine import Blame, quarantines
from services.api import RankStatus
from services.assignment import Assignment, RankEntry
from services.mesh import MeshShape
from services.records import FaultRecord, Quarantine, RecoveryRecord
from services.spec import parse_spec

SPEC = parse_spec(
    {
        "name": "j",
        "model": {"preset": "tiny"},
        "parallel": {"dp": 2},
        "train": {"steps": 100, "global_batch": 4},
        "fault_tolerance": {"quarantine_s": 30},
    }
)


def rank(n: int, **report) -> RankStatus:
    return RankStatus(
        rank=n,
        coord={"dp": n, "pp": 0, "tp": 0},
        worker=f"w{n}",
        local_rank=0,
        **{"state": "running", **report},
    )


def fault(cause: str, n: int, at: float) -> FaultRecord:
    return FaultRecord(
        cause=cause,
        rank=n,
        worker=f"w{n}",
        coord={"dp": n, "pp": 0, "tp": 0},
        fault_at=at,
        detail=f"{cause} of rank {n}",
    )


def test_a_new_record_dates_the_fault_by_its_earliest_and_keeps_the_furthest_step():
    job = Job(
        id="j",
        name="j",
        spec=SPEC,
        generation=3,
        recoveries=[
            RecoveryRecord(
                n=1,
                cause="WorkerDead",
                from_generation=1,
                fault_at=1.0,
                detected_at=2.0,
                completed_at=3.0,
            )
        ],
    )
    rec = faults.new_record(
        job,
        [rank(0, step=12), rank(1, step=14)],
        "TrainerKilled",
        [fault("TrainerKilled", 1, 95.0), fault("TrainerKilled", 0, 93.0)],
        100.0,
    )
    assert (
        rec.n,
        rec.cause,
        rec.from_generation,
        rec.fault_at,
        rec.detected_at,
        rec.last_step,
    ) == (2, "TrainerKilled", 3, 93.0, 100.0, 14)


def test_a_record_whose_ranks_left_no_report_keeps_the_step_the_job_reached():
    # every worker deregistered: their ranks read as no report (step 0), yet the job had
    # completed 23 steps, which the restore from step 0 redoes
    job = Job(id="j", name="j", spec=SPEC, generation=1, step=23)
    gone = [rank(0, state="lost"), rank(1, state="lost")]
    rec = faults.new_record(job, gone, "WorkerDead", [fault("WorkerDead", 0, 90.0)], 100.0)
    assert rec.last_step == 23
    job.recoveries = [rec.model_copy(update={"to_generation": 2, "decided_at": 101.0})]
    job.generation = 2
    times = dict(rendezvous_at=103.0, ready_at=104.0, first_step_at=105.0, start_step=0)
    done = faults.complete(job, [rank(0, **times), rank(1, **times)], 107.0)
    assert (done.record.resumed_step, done.record.steps_lost) == (0, 23)
    assert "resumed at step 0, 23 steps redone" in done.message


def test_a_rank_that_did_not_say_where_it_resumed_is_not_read_as_step_0():
    job = Job(id="j", name="j", spec=SPEC, generation=2, recoveries=[open_record()])
    times = dict(rendezvous_at=103.0, ready_at=104.0, first_step_at=105.0)
    done = faults.complete(job, [rank(0, start_step=15, **times), rank(1, **times)], 107.0)
    assert (done.record.resumed_step, done.record.steps_lost) == (15, 5)
    unsaid = faults.complete(job, [rank(0, **times), rank(1, **times)], 107.0)
    assert (unsaid.record.resumed_step, unsaid.record.steps_lost) == (None, None)
    assert "resumed at a step no rank reported" in unsaid.message


def test_a_record_without_faults_is_dated_now():
    job = Job(id="j", name="j", spec=SPEC)
    assert faults.new_record(job, [], "CapacityReturned", [], 50.0).fault_at == 50.0


def open_record() -> RecoveryRecord:
    return RecoveryRecord(
        n=1,
        cause="TrainerKilled",
        action="replace",
        from_generation=1,
        to_generation=2,
        fault_at=100.0,
        detected_at=101.0,
        decided_at=101.5,
        last_step=20,
    )


def test_completion_times_each_phase_by_the_slowest_rank():
    job = Job(id="j", name="j", spec=SPEC, generation=2, recoveries=[open_record()])
    ranks = [
        rank(0, rendezvous_at=103.0, ready_at=104.0, first_step_at=105.0, start_step=15),
        rank(1, rendezvous_at=103.5, ready_at=104.5, first_step_at=106.0, start_step=15),
    ]
    done = faults.complete(job, ranks, 107.0)
    assert isinstance(done, Complete)
    r = done.record
    assert (r.completed_at, r.resumed_step, r.steps_lost) == (107.0, 15, 5)
    assert r.durations == {
        "detect_s": 1.0,
        "decide_s": 0.5,
        "rendezvous_s": 2.0,
        "restore_s": 1.0,
        "first_step_s": 1.5,
        "total_s": 6.0,
    }
    assert "resumed at step 15, 5 steps redone" in done.message
    assert job.recoveries[0].completed_at is None  # deciding changed nothing


def test_completion_records_where_each_rank_restored_from():
    job = Job(id="j", name="j", spec=SPEC, generation=2, recoveries=[open_record()])
    times = dict(rendezvous_at=103.0, ready_at=104.0, first_step_at=105.0, start_step=19)
    ranks = [
        rank(0, restored_from="memory", **times),
        rank(1, restored_from="peer", **times),
        rank(2, restored_from="memory", **times),
    ]
    done = faults.complete(job, ranks, 107.0)
    assert done.record.restored_from == {"0": "memory", "1": "peer", "2": "memory"}
    assert "1 steps redone; restored from memory 2, peer 1" in done.message


def test_a_mark_one_rank_did_not_report_leaves_its_phases_out():
    job = Job(id="j", name="j", spec=SPEC, generation=2, recoveries=[open_record()])
    ranks = [
        rank(0, rendezvous_at=103.0, ready_at=104.0, first_step_at=105.0, start_step=15),
        rank(1, ready_at=104.5, first_step_at=106.0, start_step=15),  # no rendezvous_at
    ]
    d = faults.complete(job, ranks, 107.0).record.durations
    assert d == {"detect_s": 1.0, "decide_s": 0.5, "first_step_s": 1.5, "total_s": 6.0}


def test_a_mark_at_the_epoch_is_missing_not_a_duration_of_56_years():
    job = Job(id="j", name="j", spec=SPEC, generation=2, recoveries=[open_record()])
    ranks = [
        rank(0, rendezvous_at=103.0, ready_at=104.0, first_step_at=105.0, start_step=15),
        rank(1, rendezvous_at=0.0, ready_at=104.5, first_step_at=106.0, start_step=15),
    ]
    done = faults.complete(job, ranks, 107.0)
    d = done.record.durations
    assert d == {"detect_s": 1.0, "decide_s": 0.5, "first_step_s": 1.5, "total_s": 6.0}
    assert "rendezvous" not in done.message and "restore" not in done.message
    unknown = open_record().model_copy(update={"fault_at": 0.0})  # no fault time: no total
    job.recoveries = [unknown]
    done = faults.complete(job, ranks, 107.0)
    assert set(done.record.durations) == {"decide_s", "first_step_s"}
    assert done.message.startswith("recovery 1 (TrainerKilled, replace) done: decide 0.50s")


def test_no_completion_until_every_rank_trained_a_step():
    job = Job(id="j", name="j", spec=SPEC, generation=2, recoveries=[open_record()])
    assert faults.complete(job, [rank(0, first_step_at=105.0), rank(1)], 107.0) is None


def test_no_completion_of_a_record_for_another_generation():
    job = Job(id="j", name="j", spec=SPEC, generation=3, recoveries=[open_record()])
    assert faults.complete(job, [rank(0, first_step_at=105.0)], 107.0) is None


def test_waiting_for_capacity_names_the_lost_replicas_and_the_workers_needed():
    job = Job(id="j", name="j", spec=SPEC, generation=1)
    rec = RecoveryRecord(
        n=1,
        cause="WorkerDead",
        faults=[fault("WorkerDead", 1, 5.0)],
        from_generation=1,
        fault_at=5.0,
        detected_at=6.0,
    )
    d = faults.wait_for_capacity(job, rec, Blame())
    assert isinstance(d, WaitForCapacity)
    assert (d.record.action, d.record.to_shape) == ("wait", [2, 1, 1])
    assert d.message == (
        "WorkerDead of rank 1; no spare, and dropping the 1 DP replica(s) that "
        "lost ranks would leave dp=1 < min_dp=1 (or not divide the global "
        "batch), and no other layout fits the healthy workers: waiting for 2 workers"
    )


def test_only_causes_that_point_at_the_worker_quarantine_it_once():
    out = quarantines(
        [
            fault("RankHung", 1, 5.0),
            fault("TrainerKilled", 0, 5.0),
            fault("Straggler", 1, 6.0),
            fault("WorkerDead", 2, 5.0),
        ],
        30.0,
        100.0,
    )
    assert [q for q, _ in out] == [Quarantine(worker="w1", until=130.0, cause="RankHung")]


def test_a_killed_trainer_moves_only_a_worker_holding_one_rank():
    """dp2 x tp2 with replica 0 on one 2-device worker and replica 1 on two 1-device workers:
    a kill on the 2-device worker restarts it in place, a kill on a 1-device worker may move
    it to a spare; no other cause makes a worker movable this way."""
    shape = MeshShape(2, 1, 2)
    on = ["big", "big", "small-a", "small-b"]
    asg = Assignment(
        "j",
        1,
        shape,
        "127.0.0.1",
        1,
        [RankEntry(r, on[r], r % 2, shape.coord(r)) for r in range(4)],
    )

    def killed(n: int, cause: str = "TrainerKilled") -> FaultRecord:
        return fault(cause, n, 5.0).model_copy(update={"worker": on[n]})

    assert faults.movable_on_kill(asg, [killed(0), killed(1)]) == set()
    assert faults.movable_on_kill(asg, [killed(2)]) == {"small-a"}
    assert faults.movable_on_kill(asg, [killed(1), killed(3)]) == {"small-b"}
    assert faults.movable_on_kill(asg, [killed(2, "WorkerDead")]) == set()
