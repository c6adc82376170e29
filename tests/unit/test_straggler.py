"""Straggler detection (controller/health.py): a rank slow on every step of the window is
flagged; a burst of noise on a healthy rank is not."""

from controller.health import straggler
from services.api import RankStatus


def ranks(*windows: list[float]) -> list[RankStatus]:
    return [
        RankStatus(
            rank=i,
            worker=f"w{i}",
            coord={"dp": i, "pp": 0, "tp": 0},
            local_rank=0,
            state="running",
            window_n=len(w),
            compute_avg=sum(w) / len(w),
            compute_min=min(w),
        )
        for i, w in enumerate(windows)
    ]


HEALTHY = [0.05, 0.06, 0.05, 0.055, 0.05]


def test_a_rank_slow_on_every_step_is_flagged():
    f = straggler(ranks(HEALTHY, [0.6, 0.9, 0.7, 0.65, 0.8], HEALTHY), 1.5, 5, now=10.0)
    assert f is not None and (f.cause, f.rank, f.worker) == ("Straggler", 1, "w1")
    assert "on each of the last 5 steps" in f.detail


def test_a_burst_of_noise_is_not_flagged():
    # seen on a shared host: mean 1.85x the median, but two of five steps were normal
    burst = [0.153, 0.137, 0.158, 0.051, 0.053]
    assert sum(burst) / 5 > 1.5 * 0.058
    assert straggler(ranks(HEALTHY, burst, HEALTHY), 1.5, 5, now=10.0) is None


def test_no_verdict_before_every_rank_has_a_full_window():
    short = ranks(HEALTHY, [0.9, 0.9, 0.9], HEALTHY)
    assert straggler(short, 1.5, 5, now=10.0) is None


def test_a_healthy_rank_never_lucky_in_the_window_is_not_flagged():
    # seen on a shared host: every step of rank 2 >= 85 ms while the others had one fast step
    noisy = [
        [0.138, 0.123, 0.150, 0.068, 0.054, 0.080],
        [0.118, 0.141, 0.139, 0.104, 0.046, 0.121],
        [0.110, 0.136, 0.141, 0.085, 0.085, 0.085],
    ]
    assert straggler(ranks(*noisy), 1.5, 6, now=10.0) is None


def test_reports_without_compute_min_fall_back_to_the_mean():
    rs = [r.model_copy(update={"compute_min": None}) for r in ranks(HEALTHY, [0.6] * 5, HEALTHY)]
    assert straggler(rs, 1.5, 5, now=10.0).rank == 1
