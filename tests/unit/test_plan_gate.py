"""The planner's gate (controller/plan_gate.py): at most `concurrency` plans at once, the next
refused at once rather than queued; each owner's starts a minute bounded; a slot freed by a
plan that ends, or fails, is free again."""

from __future__ import annotations

import pytest

from controller.plan_gate import PlanGate, PlanRefused


def test_a_plan_past_the_concurrency_is_refused_at_once_and_a_freed_slot_admits():
    gate = PlanGate(concurrency=2, per_minute=100)
    with gate.admit("a"), gate.admit("b"):
        with pytest.raises(PlanRefused, match="2 plans running, at most 2") as e:
            with gate.admit("c"):
                pass
        assert e.value.retry_after_s == 1
    with pytest.raises(ValueError), gate.admit("a"):  # a plan that fails frees its slot too
        raise ValueError("the planner raised")
    with gate.admit("c"), gate.admit("d"):
        assert gate.running == 2
    assert gate.running == 0


def test_each_owner_is_bounded_per_minute_apart_from_the_others():
    gate = PlanGate(concurrency=8, per_minute=2)
    for _ in range(2):
        with gate.admit("viewer"):
            pass
    with pytest.raises(PlanRefused, match="'viewer' started 2 plans") as e:
        with gate.admit("viewer"):
            pass
    assert 1 <= e.value.retry_after_s <= 61
    with gate.admit("submitter"):  # another owner still plans
        pass
