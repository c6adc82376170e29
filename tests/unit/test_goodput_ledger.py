"""The goodput ledger's arithmetic (controller/goodput.py) on a synthetic timeline, the job read
back from a real Redis before every pass, as the next pass (or another controller) reads it:
the parts add up to the wall time exactly, every pass can be tried first and thrown away (a
pass fenced out before it wrote) without a second charged twice, the counters never go back,
and recovery records trimmed off the job stay counted."""

from __future__ import annotations

import pytest

from controller import goodput
from controller.apply import KEEP_RECORDS
from controller.faults import new_record
from controller.jobs import Job
from services import api
from services.records import Overheads, RecoveryRecord
from services.spec import parse_spec
from services.store import Store, flat

T0 = 1000.0
SPEC = parse_spec(
    {"name": "g", "model": {"preset": "tiny"}, "train": {"steps": 100, "global_batch": 4}}
)
PHASES = {"detect_s": 1.0, "decide_s": 0.5, "rendezvous_s": 2.0, "restore_s": 1.5}


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="ledger:")
    yield s
    s.close()


def world(steps, progress, firsts=(None, None), overheads=None) -> list[api.RankStatus]:
    """Two ranks' view (rank 0 first), each beat 0.1 s after its last report."""
    return [
        api.RankStatus(
            rank=i,
            coord=api.Coordinate(dp=i, pp=0, tp=0),
            worker=f"w{i}",
            local_rank=0,
            state="running",
            step=steps[i],
            progress_at=T0 + progress[i],
            first_step_at=None if firsts[i] is None else T0 + firsts[i],
            overheads=Overheads(**overheads) if i == 0 and overheads else Overheads(),
        )
        for i in range(2)
    ]


def beats(ranks: list[api.RankStatus]) -> dict[str, float]:
    return {r.worker: r.progress_at + 0.1 for r in ranks}


class Timeline:
    """One job through passes. Each pass reads it from Redis, runs once on a copy that is
    thrown away (a pass that lost its lease before writing), then again and writes; the
    counters are read between passes and may only grow."""

    def __init__(self, store: Store):
        self.store = store
        job = Job(id="g", name="g", spec=SPEC, submitted_at=T0)
        job.set("Running", False, "Queued", "waiting for the scheduler", T0)
        submitted = {"spec": SPEC.model_dump(mode="json"), "submitted_at": T0}
        store.create_job("g", {**submitted, **job.fields()})
        self.scraped: list[dict[str, float]] = []

    def read(self) -> Job:
        return Job.from_hash("g", self.store.job("g"))

    def write(self, job: Job) -> None:
        self.store.r.hset(self.store.keys.job("g"), mapping=flat(job.fields()))

    def run(self, at: float, change) -> Job:
        """A pass at T0 + `at`: `change(job, now)` is what it does; returns the job written."""
        now = T0 + at
        change(self.read(), now)  # tried and lost: nothing written
        job = self.read()
        change(job, now)
        self.write(job)
        scrape = goodput.settled(self.read(), now)
        if self.scraped:
            assert all(scrape[k] >= self.scraped[-1][k] for k in scrape), (self.scraped[-1], scrape)
        self.scraped.append(scrape)
        return job


def place(generation: int):
    """A pass that places the job (controller/placing.py)."""

    def change(job: Job, now: float) -> None:
        goodput.account(job, now)
        goodput.placed(job, now)
        job.generation = generation
        if job.condition("Preempted"):
            job.set("Preempted", False, "Placed", "placed again", now)
        job.set("Running", True, "Starting", "placed", now)

    return change


def follow(ranks: list[api.RankStatus], step: int | None = None, record=None):
    """A pass that follows the running job (controller/following.py): the ledger, the step
    the pass absorbed, and whatever fault handling wrote (`record`)."""

    def change(job: Job, now: float) -> None:
        goodput.account(job, now, ranks, beats(ranks))
        job.step = step if step is not None else job.step
        if record is not None:
            record(job, now)

    return change


def test_a_kill_a_preemption_and_a_wait_add_up_to_the_wall_time(store):
    t = Timeline(store)
    t.run(10, lambda job, now: goodput.account(job, now))  # queued: waiting
    t.run(12, place(1))
    t.run(14, follow(world([0, 0], [13.5, 13.5])))  # starting: no first step yet
    # the first step ends the start at 15.5 (the slower rank's): waiting since submission
    t.run(16, follow(world([2, 2], [16, 15.8], (15, 15.5)), step=2))
    # rank 0 saved (1 s blocked) and evaluated (0.5 s): paid from the training since
    overheads = {"checkpoint_s": 1.0, "eval_s": 0.5}
    t.run(30, follow(world([20, 20], [30, 29.5], (15, 15.5), overheads), step=20))

    def killed(job: Job, now: float) -> None:  # rank 1 died at 31; seen at 32
        rec = RecoveryRecord(
            n=1,
            cause="TrainerKilled",
            from_generation=1,
            to_generation=2,
            fault_at=T0 + 31,
            detected_at=T0 + 32,
            decided_at=T0 + 32.5,
            last_step=21,
        )
        job.recoveries, job.generation = [rec], 2
        job.set("Recovering", True, "ReplacingRank", "rank 1 killed", now)

    # reports as old as 30.9 settle training up to there, not to the fault
    t.run(32, follow(world([21, 20], [31.8, 30.9], (15, 15.5), overheads), record=killed))
    t.run(34, follow(world([19, 19], [33.5, 33.5])))  # the new world restores

    def completed(job: Job, now: float) -> None:  # what faults.complete wrote last pass
        durations = {**PHASES, "first_step_s": 2.0, "total_s": 7.0}
        job.recoveries[-1] = job.recoveries[-1].model_copy(
            update={"completed_at": now - 2, "resumed_step": 19, "durations": durations}
        )
        job.set("Recovering", False, "Recovered", "done", now)

    t.run(38.5, follow(world([19, 19], [38.4, 38.4]), record=completed))
    # first step at 38 (fault 31 + 7 s): step 20 is behind the 21 rank 0 had reached
    t.run(39.5, follow(world([20, 20], [39.6, 39.5], (38, 37.8)), step=20))
    t.run(41, follow(world([21, 21], [41, 41], (38, 37.8)), step=21))
    # a new world's totals start again from nothing
    overheads = {"snapshot_s": 0.25}
    t.run(50, follow(world([30, 30], [50, 50], (38, 37.8), overheads), step=30))

    def preempted(job: Job, now: float) -> None:  # apply._stop: the world stops now
        goodput.account(job, now)
        goodput.stopped(job, now)
        job.set("Running", False, "Preempted", "preempted", now)
        job.set("Preempted", True, "Preempted", "preempted by high", now)

    t.run(52, preempted)
    t.run(60, lambda job, now: goodput.account(job, now))  # queued again: suspended
    t.run(62, place(3))
    t.run(66, follow(world([31, 31], [66, 66], (64, 65)), step=31))  # the start ends at 65

    def finished(job: Job, now: float) -> None:
        goodput.account(job, now)
        goodput.stopped(job, now)
        job.finished_at = now
        job.set("Succeeded", True, "AllRanksSucceeded", "done", now)

    job = t.run(70, finished)
    got = goodput.view(job, T0 + 1000)  # ended: nothing more is charged
    want = {
        "productive_s": 0.3 + 12.2 + 1.4 + 0.1 + 8.75 + 2 + 1 + 4,
        "redone_s": 1.5 + 1.5,  # from the first step (38) until the world was back at 21 (41)
        "recovery_s": 7.0,  # the fault (31) to the new world's first step (38)
        "checkpoint_s": 1.0,
        "snapshot_s": 0.25,
        "eval_s": 0.5,
        "waiting_s": 15.5,  # submitted (0) to the first step (15.5)
        "suspended_s": 13.0,  # preempted (52) to the next world's first step (65)
    }
    assert got.parts.model_dump() == pytest.approx(want, abs=1e-9)
    assert got.wall_s == 70.0 and sum(want.values()) == pytest.approx(70.0)
    assert got.recovery_phases.model_dump() == pytest.approx(
        {**PHASES, "first_step_s": 2.0}, abs=1e-9
    )
    assert got.ettr == pytest.approx(want["productive_s"] / (70.0 - 13.0))
    assert t.scraped[-1] == pytest.approx(want, abs=1e-9)  # the counters, once it ended


def test_the_save_a_job_ends_with_is_charged_to_checkpointing(store):
    """Rank 0 reports its final save's blocking only as it exits: the pass that ends the job
    owes it from the final view, so it is not counted as training."""
    t = Timeline(store)
    t.run(2, place(1))
    t.run(10, follow(world([8, 8], [10, 10], (3, 3)), step=8))
    final = world([10, 10], [11.9, 11.9], (3, 3), {"checkpoint_s": 1.5})

    def finished(job: Job, now: float) -> None:  # apply._stop, with the final rank view
        goodput.account(job, now)
        goodput.stopped(job, now, final)
        job.set("Succeeded", True, "AllRanksSucceeded", "done", now)

    job = t.run(12, finished)
    parts = goodput.view(job, T0 + 100).parts
    assert parts.checkpoint_s == 1.5
    assert parts.productive_s == pytest.approx(7.0 + 2.0 - 1.5)  # from the first step (3)
    assert sum(parts.model_dump().values()) == pytest.approx(12.0)


def test_an_open_recovery_shows_its_phases_so_far_and_the_parts_still_add_up(store):
    """While a recovery is open the status shows it until now, split as far as its record
    knows (detected, decided; the rest is the new world's rendezvous so far)."""
    job = Job(id="g", name="g", spec=SPEC, submitted_at=T0, generation=1)
    job.set("Running", True, "Training", "training", T0)
    goodput.account(job, T0 + 10, world([5, 5], [10, 10], (1, 1)), {})
    job.recoveries = [
        RecoveryRecord(
            n=1,
            cause="WorkerDead",
            from_generation=1,
            fault_at=T0 + 11,
            detected_at=T0 + 13,
            decided_at=T0 + 13.5,
            last_step=6,
        )
    ]
    job.set("Recovering", True, "ReplacingRank", "worker w1 silent", T0 + 13)
    got = goodput.view(job, T0 + 20)
    assert got.wall_s == 20.0
    assert (got.parts.productive_s, got.parts.recovery_s) == (11.0, 9.0)  # the fault at 11
    assert got.recovery_phases.model_dump() == pytest.approx(
        {
            "detect_s": 2.0,
            "decide_s": 0.5,
            "rendezvous_s": 6.5,
            "restore_s": 0.0,
            "first_step_s": 0.0,
        }
    )
    assert sum(got.parts.model_dump().values()) == pytest.approx(20.0)


def test_records_trimmed_off_the_job_stay_counted_and_new_ones_number_after_them(store):
    """The job keeps its newest KEEP_RECORDS recoveries; the ledger counts each once, by number,
    so the recoveries it keeps counting past the cap are the new ones, never the kept ones
    again, and a new record is numbered after the newest kept one (not by the list's length)."""
    t = Timeline(store)
    steps = KEEP_RECORDS + 5

    def kill(k: int):
        def change(job: Job, now: float) -> None:
            view = world([k, k], [now - T0 - 0.5] * 2, (6, 6))
            goodput.account(job, now, view, beats(view))
            if job.recoveries and job.recoveries[-1].completed_at is None:  # done: 1 s after
                job.recoveries[-1] = job.recoveries[-1].model_copy(
                    update={"completed_at": now, "durations": {"total_s": 1.0}}
                )
            rec = new_record(job, view, "TrainerKilled", [], now)
            rec.fault_at = now - 0.25
            job.recoveries = (job.recoveries + [rec])[-KEEP_RECORDS:]
            job.set("Running", True, "Training", "training", now)

        return change

    t.run(5, place(1))
    for k in range(1, steps + 1):
        t.run(10.0 * k, kill(k))
    job = t.read()
    assert [r.n for r in job.recoveries] == list(range(6, steps + 1))
    # 1 s each, the trimmed ones included: all but the newest two, which the next pass closes
    assert job.goodput.parts["recovery_s"] == pytest.approx(steps - 2.0)
    assert sum(goodput.view(job, T0 + 10.0 * steps).parts.model_dump().values()) == (
        pytest.approx(10.0 * steps)
    )
