"""worker/agent/retry.py: an outage is ridden out, logged once going down and once coming back;
what retrying cannot fix is not retried; a stop ends the wait."""

from __future__ import annotations

import logging
import threading

import pytest

from worker.agent.retry import Outage


class Down(Exception):
    pass


def flaky(failures: int):
    calls = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise Down(f"try {len(calls)}")
        return "up"

    return call, calls


def test_retries_until_it_answers_and_logs_once_each_way(caplog):
    failed = []
    outage = Outage(
        Down,
        0.01,
        threading.Event(),
        on_failure=failed.append,
        down="thing down (%s)",
        back="thing back",
    )
    call, calls = flaky(3)
    with caplog.at_level(logging.INFO, "meshkeeper.agent"):
        assert outage.call(call) == "up"
        assert outage.call(call) == "up"  # up already: nothing more to say
    assert len(calls) == 5 and [str(e) for e in failed] == ["try 1", "try 2", "try 3"]
    assert [r.getMessage() for r in caplog.records] == ["thing down (try 1)", "thing back"]


def test_an_error_it_does_not_retry_propagates_at_once():
    calls = []

    def refused():
        calls.append(1)
        raise SystemExit("refused")

    with pytest.raises(SystemExit, match="refused"):
        Outage(Down, 0.01, threading.Event(), down="%s", back="").call(refused)
    assert len(calls) == 1


def test_a_stop_ends_the_retries_with_none():
    stop = threading.Event()
    call, calls = flaky(10**6)

    def sleep(seconds: float) -> None:
        if len(calls) == 3:
            stop.set()

    outage = Outage(Down, 0.01, stop, sleep=sleep, down="%s", back="back")
    assert outage.call(call) is None
    assert len(calls) == 3 and outage.is_down
