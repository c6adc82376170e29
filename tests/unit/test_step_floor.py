"""`chaos.min_step_s` (worker/trainer/chaos.py `StepFloor`): each step lasts at least the
floor, counted from the end of the previous wait, so the work inside a step is not added on
top of it. Lower bounds on real sleeps, and the sleep asked for; no timing targets."""

from __future__ import annotations

import time

from worker.trainer.chaos import StepFloor


def test_quick_steps_are_stretched_to_the_floor():
    t0 = time.monotonic()  # before the floor starts counting, so no gap is overstated
    floor = StepFloor(0.05)
    ends = []
    for _ in range(4):
        floor.wait()
        # The floor's own end of each wait: a clock read here, after it, would sit a few
        # microseconds later and shorten the next gap by as much (CI saw 0.0499).
        ends.append(floor.last)
    gaps = [b - a for a, b in zip([t0, *ends[:-1]], ends, strict=True)]
    assert all(g >= 0.05 for g in gaps), gaps


def test_a_step_longer_than_the_floor_is_not_paced_further(monkeypatch):
    floor = StepFloor(0.3)
    time.sleep(0.4)  # the step's own work outlasts the floor
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)  # record what the floor asks for
    floor.wait()
    assert slept == []  # the rest was negative: the floor is not added on top
