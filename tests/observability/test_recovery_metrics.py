"""A real recovery (a rank's trainer killed, a spare promoted) as the controller's metrics
tell it: the recovery record is observed exactly once in the detection, recovery and phase
histograms, and the restart is counted under its cause."""

from __future__ import annotations

import os
import signal

from tests.integration.conftest import tiny_spec, wait_until
from tests.observability.exposition import check_metrics, samples, value


def test_a_recovery_is_counted_once_under_its_cause(obs, promtool):
    spec = tiny_spec("obs-recovery", train={"steps": 2000}, checkpoint={"every_steps": 5},
                     fault_tolerance={"spares": 1})
    job = obs.client.submit(spec).id
    try:
        wait_until(lambda: (j := obs.client.job(job)).last_checkpoint and all(
            r.state == "running" for r in j.mesh.ranks), 120, "both ranks running past a checkpoint")
        victim = next(r for r in obs.client.job(job).mesh.ranks if r.rank == 1)
        os.kill(victim.pid, signal.SIGKILL)
        status = wait_until(lambda: (j := obs.client.job(job)).recoveries and j.recoveries[-1].completed_at
                            and j, 180, "the recovery to complete")
        [record] = status.recoveries
        cause = record.cause

        text = obs.scrape_controller()
        check_metrics(promtool, text)
        assert value(text, "meshkeeper_job_restarts_total", job_id=job, reason=cause) == 1
        assert value(text, "meshkeeper_recovery_lost_steps_total", job_id=job) == record.steps_lost
        assert not samples(text, "meshkeeper_job_recovering_seconds", job_id=job)  # recovered
        for _ in range(2):  # a second scrape must not observe the same record again
            text = obs.scrape_controller()
            assert value(text, "meshkeeper_recovery_duration_seconds_count", cause=cause) == 1
            assert value(text, "meshkeeper_fault_detection_seconds_count", cause=cause) == 1
            assert value(text, "meshkeeper_recovery_duration_seconds_sum", cause=cause) == (
                record.durations["total_s"])
            for phase in ("decide", "rendezvous", "restore", "first_step"):
                assert value(text, "meshkeeper_recovery_phase_duration_seconds_count", phase=phase) == 1
    finally:
        obs.client.cancel(job)
