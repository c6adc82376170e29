"""`chaos.min_step_s` (worker/trainer/chaos.py `StepFloor`): each step lasts at least the
floor, counted from the end of the previous wait, so the work inside a step is not added on
top of it. Lower bounds only: a sleep is never shorter than asked."""

from __future__ import annotations

import time

from worker.trainer.chaos import StepFloor


def test_quick_steps_are_stretched_to_the_floor():
    floor = StepFloor(0.05)
    t0 = time.monotonic()
    ends = []
    for _ in range(4):
        floor.wait()
        ends.append(time.monotonic())
    gaps = [b - a for a, b in zip([t0, *ends[:-1]], ends, strict=True)]
    assert all(g >= 0.05 for g in gaps), gaps


def test_a_step_longer_than_the_floor_is_not_paced_further():
    floor = StepFloor(0.3)
    time.sleep(0.4)  # the step's own work outlasts the floor
    t = time.monotonic()
    floor.wait()
    # the rest was negative: no sleep at all (a wait of 0.3 s would be the floor added on top)
    assert time.monotonic() - t < 0.3
