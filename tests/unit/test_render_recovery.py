"""cli/render.py: a recovery's phases as `meshkeeper` prints them, only those measured."""

from __future__ import annotations

from cli import render
from services.records import RecoveryRecord
from tests.unit.test_decisions import open_record


def record(durations: dict[str, float]) -> RecoveryRecord:
    return open_record().model_copy(
        update={"resumed_step": 7, "steps_lost": 1, "durations": durations}
    )


def test_every_phase_measured_is_printed_in_order():
    d = {
        "detect_s": 4.0,
        "decide_s": 0.1,
        "rendezvous_s": 1.0,
        "restore_s": 0.5,
        "first_step_s": 0.4,
        "total_s": 6.0,
    }
    text = render.recovery(record(d)).plain
    assert (
        "detect 4.00s, decide 0.10s, rendezvous 1.00s, restore 0.50s, first step 0.40s "
        "= 6.00s from fault to training"
    ) in text


def test_a_phase_not_measured_is_left_out_not_a_crash():
    d = {"detect_s": 4.0, "decide_s": 0.1, "first_step_s": 0.4, "total_s": 6.0}
    text = render.recovery(record(d)).plain
    assert "decide 0.10s, first step 0.40s = 6.00s" in text and "rendezvous" not in text


def test_a_recovery_with_no_fault_time_prints_no_total():
    text = render.recovery(record({"decide_s": 0.1, "first_step_s": 0.4})).plain
    assert text.endswith("decide 0.10s, first step 0.40s")
