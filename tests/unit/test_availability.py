"""controller/availability.py: when heartbeat silence may be judged. A hand-driven clock;
the observations are what the reconcile loop feeds it (round trips answered or failed, and
redis-server's uptime)."""

from __future__ import annotations

from controller.availability import RedisAvailability


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def passes(
    a: RedisAvailability,
    clock: Clock,
    seconds: float,
    every: float = 0.25,
    uptime0: int | None = None,
) -> None:
    """Healthy reconcile passes for `seconds`."""
    end = clock.t + seconds
    while clock.t < end:
        clock.t += every
        a.answered(None if uptime0 is None else uptime0 + int(clock.t - 1000.0))


def test_not_before_a_full_window_after_our_own_start():
    c = Clock()
    a = RedisAvailability(c)
    assert not a.steady(2.0)
    a.answered(3600)
    passes(a, c, 1.5)
    assert not a.steady(2.0)
    passes(a, c, 0.5)
    assert a.steady(2.0)


def test_a_stall_longer_than_half_the_window_holds_judging_for_a_window():
    c = Clock()
    a = RedisAvailability(c)
    passes(a, c, 5)
    assert a.steady(2.0)
    c.t += 4.0  # one round trip took 4 s (Redis SIGSTOPped), then it answered
    a.answered()
    assert not a.steady(2.0)
    passes(a, c, 1.5)
    assert not a.steady(2.0)
    passes(a, c, 0.5)
    assert a.steady(2.0)
    assert a.gaps == 1


def test_a_short_gap_does_not_matter_but_counts_for_a_tighter_job():
    c = Clock()
    a = RedisAvailability(c)
    passes(a, c, 5)
    c.t += 0.8  # a slow pass
    a.answered()
    assert a.steady(2.0)  # 0.8 s < dead_after_s / 2
    assert not a.steady(1.0)  # but a job with dead_after_s 1.0 waits


def test_failures_hold_judging_until_back_for_a_window():
    c = Clock()
    a = RedisAvailability(c)
    passes(a, c, 5)
    for _ in range(8):  # Redis refuses connections for 2 s
        c.t += 0.25
        a.failed("Connection refused")
        assert not a.steady(2.0) and a.down
    a.answered()
    assert not a.down and not a.steady(2.0)
    passes(a, c, 2.0)
    assert a.steady(2.0)


def test_a_restart_between_two_passes_is_told_by_uptime():
    c = Clock()
    a = RedisAvailability(c)
    passes(a, c, 10, uptime0=500)
    assert a.steady(2.0)
    c.t += 0.25
    a.answered(0)  # restarted since the last pass, too quickly for a gap to show
    assert a.restarts == 1
    assert not a.steady(2.0)
    passes(a, c, 2.5, uptime0=0 - 10)  # uptime counts on from the restart
    assert a.steady(2.0)


def test_an_open_interval_since_the_last_answer_is_a_gap_already():
    c = Clock()
    a = RedisAvailability(c)
    passes(a, c, 5)
    c.t += 0.9  # the watcher's round trip is in flight (Redis stopped), nothing recorded yet
    assert a.steady(2.0)  # under dead_after_s / 2: as harmless as a closed gap of that size
    c.t += 0.2
    assert not a.steady(2.0)  # the reconcile pass asks first: it must not judge meanwhile
    a.answered()
    assert not a.steady(2.0) and a.gaps == 1  # then recorded, it holds judging for a window
