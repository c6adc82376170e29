"""A device error (`chaos.device_error`: torch's own AcceleratorError, raised in one rank's
trainer at a chosen step, the error a CUDA fault raises) on the shared stack.

- Once, as a failing GPU would: the rank exits with `EXIT_DEVICE`, its worker is blamed,
  replaced by the spare and quarantined, the other ranks are collateral, and the job ends on
  the uninterrupted run's exact loss curve.
- At the same step again on the worker that replaced it (`repeat`), as a fault of the job's
  own would: the job fails with a message naming the step and both workers, after one spare.
"""

from __future__ import annotations

import pytest

from tests.chaos.chaos import (
    Watch,
    assert_curve,
    completed,
    events,
    free_pool,
    mesh_spec,
    start,
    succeeded,
)
from tests.stack import wait_until

pytestmark = pytest.mark.slow

FAIL_AT = 8


def test_a_device_error_replaces_and_quarantines_its_worker_and_keeps_the_exact_loss(
    stack, uninterrupted
):
    # quarantined for 5 s: seen out of the pool right after the recovery, over by the job's end
    spec = mesh_spec("device-error", quarantine_s=5)
    want = uninterrupted(spec)
    spec["chaos"] = {"device_error": [{"rank": 1, "step": FAIL_AT}]}
    w, j1 = start(stack, spec)
    victim = next(r for r in j1.mesh.ranks if r.rank == 1)
    spare = j1.mesh.spares[0]
    j = w.until(lambda j: j.generation >= 2, 120, "a recovery from the device error")
    rec = j.recoveries[0]
    assert (rec.cause, rec.action) == ("DeviceError", "replace"), rec
    assert [(f.rank, f.worker, f.cause) for f in rec.faults] == [
        (1, victim.worker, "DeviceError")
    ], rec.faults
    detail = rec.faults[0].detail
    assert f"device error during step {FAIL_AT}; trainer exited with code 7" in detail, detail
    assert "an illegal memory access was encountered" in detail, detail
    assert rec.faults[0].evidence == {"step": FAIL_AT}, rec.faults[0]  # no NVML on a CPU
    assert rec.replaced == [{"old": victim.worker, "new": spare}], rec
    assert [q.worker for q in rec.quarantined] == [victim.worker], rec.quarantined
    health = stack.store.r.hgetall(f"mk:worker:{victim.worker}:health")
    assert health.get("cause") == "DeviceError", health
    assert victim.worker not in free_pool(stack)

    j = w.finish()
    succeeded(stack, j)
    assert [(r.cause, r.action) for r in j.recoveries] == [("DeviceError", "replace")]
    completed(j.recoveries[0])
    assert_curve(stack, j, want, exact=True)
    wait_until(lambda: victim.worker in free_pool(stack), 90, "the worker re-admitted")


def test_a_device_error_again_at_the_same_step_on_the_replacement_fails_the_job(stack):
    spec = mesh_spec("device-error-twice")
    spec["chaos"] = {"device_error": [{"rank": 1, "step": FAIL_AT, "repeat": True}]}
    jid = stack.client.submit(spec).id
    j = Watch(stack, jid).finish(180)
    assert j.phase == "Failed", (j.phase, [(c.type, c.reason, c.message) for c in j.conditions])
    failed = j.condition("Failed")
    assert failed.reason == "DeviceErrorRepeated", failed
    first = j.recoveries[0]
    assert [(r.cause, r.action) for r in j.recoveries] == [("DeviceError", "replace")]
    old, new = first.replaced[0]["old"], first.replaced[0]["new"]
    assert (
        f"rank 1 failed with a device error during step {FAIL_AT} on worker {old}, and again "
        f"on {new}, which replaced it" in failed.message
    ), failed.message
    assert "token ids below model.vocab" in failed.message, failed.message
    assert (j.restarts, j.generation) == (1, 2), (j.restarts, j.generation)
    assert [e.reason for e in events(stack, jid)].count("RecoveryStarted") == 1
