"""Process-group timeouts against the controller's hang bound (services/hang_bounds.py): on
CUDA every group gives up strictly before the controller would call the rank hung, before
and after the first step, so NCCL's watchdog's evidence arrives first; on CPU the groups
outlast the bound, and the controller finds the hung rank itself. The start-up grace grows with
the model's size."""

from __future__ import annotations

import pytest

from services.hang_bounds import (
    STARTUP_GRACE_S,
    collective_timeout_s,
    hang_bound_s,
    startup_grace_s,
)

SMALL = 10**6  # parameters: a tiny model, whose grace is the floor's


@pytest.mark.parametrize("hang_after_s", [2.0, 30.0, 60.0, 600.0, 3600.0])
@pytest.mark.parametrize("stepping", [False, True])
def test_on_cuda_the_groups_give_up_before_the_controller(hang_after_s, stepping):
    for params in (SMALL, 70 * 10**9):
        bound = hang_bound_s(hang_after_s, stepping, params)
        timeout = collective_timeout_s(hang_after_s, cuda=True, stepping=stepping, params=params)
        assert timeout == bound / 2


def test_the_first_step_gets_the_start_up_grace():
    assert hang_bound_s(60.0, False, SMALL) == pytest.approx(STARTUP_GRACE_S, abs=0.01)
    assert collective_timeout_s(60.0, True, False, SMALL) == pytest.approx(
        STARTUP_GRACE_S / 2, abs=0.01
    )
    assert collective_timeout_s(60.0, cuda=True, stepping=True, params=SMALL) == 30.0


def test_the_start_up_grace_grows_with_the_model_and_the_steady_bound_does_not():
    assert startup_grace_s(70 * 10**9) == 650.0  # 300 s + 5 s per billion
    assert hang_bound_s(60.0, False, 70 * 10**9) == 650.0 > hang_bound_s(60.0, False, 10**9)
    assert hang_bound_s(60.0, True, 70 * 10**9) == 60.0


@pytest.mark.parametrize("hang_after_s", [2.0, 30.0, 60.0, 600.0])
def test_on_cpu_the_groups_outlast_the_controller(hang_after_s):
    timeout = collective_timeout_s(hang_after_s, cuda=False, stepping=True, params=SMALL)
    assert timeout == max(60.0, hang_after_s) >= hang_bound_s(hang_after_s, True, SMALL)
