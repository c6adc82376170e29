"""Priorities and preemption (docs/control-plane.md, "Priorities and preemption") on a pool of
three real agents that one low-priority dp2 job (and its spare) fills: a high-priority job
arrives, the low one commits a step and yields, the high one runs to its end, and the low one
is placed again and continues from its commit. Both succeed; the low one with the loss curve
of its uninterrupted run, bit for bit, and no step redone."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import paced_spec, resumed_once, start, succeeded
from tests.security.smallpool import SmallPool
from tests.stack import tiny_spec, wait_phase

pytestmark = pytest.mark.slow


@pytest.fixture
def pool(tmp_path):
    p = SmallPool(tmp_path, 3, controller_flags=["--allow-chaos"])  # the low job is paced
    yield p
    p.close()


def test_a_high_priority_job_preempts_a_low_one_that_resumes_to_the_exact_loss(pool, uninterrupted):
    spec = {**paced_spec("low"), "priority": {"class": "low"}}
    want = uninterrupted(spec)
    w, _ = start(pool, spec)  # two ranks and a spare: the whole pool
    w.until(lambda j: j.step >= 4, 90, "the low job to train")

    high = pool.client.submit(
        tiny_spec("high", priority={"class": "high"}, fault_tolerance={"spares": 0})
    ).id
    yielded = w.until(lambda j: j.phase == "Pending", 90, "the low job to yield")
    why = yielded.condition("Preempted")
    assert why.status == "True" and f"preempted by {high}" in why.message, yielded.conditions
    assert (yielded.generation, yielded.restarts) == (1, 0)
    wait_phase(pool.client, high, ("Running",), 60)
    assert pool.client.job(w.jid).phase == "Pending"  # the workers it freed went to `high`
    done = wait_phase(pool.client, high, ("Succeeded",), 180)
    succeeded(pool, done)
    j = w.finish()
    assert j.condition("Preempted").status == "False"  # placed again: history, not state
    stop = resumed_once(pool, j, want)
    assert stop > 4
    told = [e.message for e in pool.client.events(w.jid, limit=500) if e.reason == "Preempting"]
    assert told == [f"stopping to free its workers for {high} (priority class high)"]
