"""`meshkeeper up` stopped mid-job and started again on its run dir (cli/stop_and_resume.py):
the stop suspends the job at a committed step before anything exits, the next `up` resumes
it, and it finishes with no restart counted and the loss of an uninterrupted run, bit for
bit, each step run once."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import paced_spec, resumed_once, start
from tests.chaos.conftest import UP_WORKERS
from tests.stack import wait_until

pytestmark = pytest.mark.slow


def test_up_stopped_mid_job_resumes_it_where_it_stopped(up, uninterrupted):
    spec = paced_spec("up-stop")
    want = uninterrupted(spec)
    w, _ = start(up, spec)
    w.until(lambda j: j.step >= 4, 60, "a few steps")

    up.restart(UP_WORKERS)  # SIGTERM, as Ctrl-C or a service manager stops it
    assert f"suspended {w.jid}" in up.log.read_text(), up.logs()  # before it stopped
    # the new `up` resumes it once its stack is ready, which is what restart waited for
    wait_until(lambda: f"resumed {w.jid}" in up.log.read_text(), 30, "the job resumed")

    stop = resumed_once(up, w.finish(), want)
    assert stop > 4
    suspended = [e.message for e in up.client.events(w.jid, limit=500) if e.reason == "Suspended"]
    want = f"every rank committed step {stop} and stopped; resume continues from its last commit"
    assert suspended == [want]
