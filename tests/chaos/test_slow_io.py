"""A checkpoint save slower than `hang_after_s` (storage slowed by `chaos.save_delay_s`, a
wait in every rank's storage writer) is progress, not a hang: the trainer's I/O ticker
(worker/trainer/io_progress.py) writes `io` lines while the save is open, and the job ends
without a recovery."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import Watch, mesh_spec, metrics_path, records, succeeded

pytestmark = pytest.mark.slow

HANG_AFTER_S = 4.0
SAVE_DELAY_S = 3 * HANG_AFTER_S


def test_a_save_slower_than_hang_after_s_causes_no_recovery(stack):
    spec = mesh_spec("slow-save", steps=10, hang_after_s=HANG_AFTER_S)
    spec["checkpoint"] = {"every_steps": 5, "mode": "sync"}  # the training thread waits it out
    spec["chaos"] = {"save_delay_s": SAVE_DELAY_S}
    j = Watch(stack, stack.client.submit(spec).id).finish(300)
    assert (j.restarts, j.recoveries) == (0, []), j.recoveries  # no RankHung, no restart
    succeeded(stack, j)
    ticks = [r for r in records(metrics_path(stack, j, 0)) if r.get("event") == "io"]
    saves = {r["step"] for r in ticks if r["phase"] == "save"}
    assert saves == {5, 10}, ticks
    assert max(r["elapsed_s"] for r in ticks) >= HANG_AFTER_S, ticks
