"""A real recovery (a rank's trainer killed after a checkpoint, a spare promoted) as the
metrics tell it: the controller observes the recovery record exactly once in the detection,
recovery and phase histograms and counts the restart under its cause; the agents time the
checkpoint save and the restore."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import pytest

from services import api
from tests.observability.exposition import check_metrics, samples, value
from tests.stack import tiny_spec, wait_until


@dataclass
class Recovered:
    job: str
    status: api.JobStatus
    record: api.Recovery
    before: str  # the controller's exposition just before the fault: the stack is shared, so
    # the cause's histograms may already hold earlier tests' recoveries


@pytest.fixture(scope="module")
def recovered(obs_stack) -> Recovered:
    obs = obs_stack
    obs.idle()
    spec = tiny_spec(
        "obs-recovery",
        train={"steps": 2000},
        checkpoint={"every_steps": 5},
        fault_tolerance={"spares": 1},
    )
    job = obs.client.submit(spec).id
    try:
        wait_until(
            lambda: (
                (j := obs.client.job(job)).last_checkpoint
                and all(r.state == "running" for r in j.mesh.ranks)
            ),
            120,
            "both ranks running past a checkpoint",
        )
        victim = next(r for r in obs.client.job(job).mesh.ranks if r.rank == 1)
        before = obs.scrape_controller()
        os.kill(victim.pid, signal.SIGKILL)
        status = wait_until(
            lambda: (j := obs.client.job(job)).recoveries and j.recoveries[-1].completed_at and j,
            180,
            "the recovery to complete",
        )
        yield Recovered(job, status, status.recoveries[-1], before)
    finally:
        obs.client.cancel(job)


def test_the_controller_counts_a_recovery_once_under_its_cause(obs_stack, recovered, promtool):
    job, record = recovered.job, recovered.record
    assert len(recovered.status.recoveries) == 1
    text = obs_stack.scrape_controller()
    check_metrics(promtool, text)
    assert value(text, "meshkeeper_job_restarts_total", job_id=job, reason=record.cause) == 1
    assert value(text, "meshkeeper_recovery_lost_steps_total", job_id=job) == record.steps_lost
    assert not samples(text, "meshkeeper_job_recovering_seconds", job_id=job)  # recovered
    before = recovered.before

    def grew(text: str, name: str, **labels: str) -> float:
        # before the fault the series may not exist yet (no recovery of that cause so far)
        return value(text, name, **labels) - sum(x.value for x in samples(before, name, **labels))

    for _ in range(2):  # a second scrape must not observe the same record again
        text = obs_stack.scrape_controller()
        c = record.cause
        assert grew(text, "meshkeeper_recovery_duration_seconds_count", cause=c) == 1
        assert grew(text, "meshkeeper_fault_detection_seconds_count", cause=c) == 1
        assert grew(text, "meshkeeper_recovery_duration_seconds_sum", cause=c) == pytest.approx(
            record.durations["total_s"], rel=1e-9, abs=1e-9
        )
        for phase in ("decide", "rendezvous", "restore", "first_step"):
            assert grew(text, "meshkeeper_recovery_phase_duration_seconds_count", phase=phase) == 1


def test_the_agents_time_checkpoint_saves_and_the_restore(obs_stack, recovered):
    scrapes = [obs_stack.scrape(r.worker) for r in recovered.status.mesh.ranks]
    job = recovered.job
    restores = sum(
        s.value
        for t in scrapes
        for s in samples(t, "meshkeeper_checkpoint_restore_seconds_count", job_id=job)
    )
    saves = sum(
        s.value
        for t in scrapes
        for s in samples(t, "meshkeeper_checkpoint_save_blocking_seconds_count", job_id=job)
    )
    assert restores == len(recovered.status.mesh.ranks), "every rank of the new generation restored"
    assert saves >= 1
