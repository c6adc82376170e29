"""Process-group timeouts against the controller's hang bound (services/hang_bounds.py): on
CUDA every group gives up strictly before the controller would call the rank hung, before
and after the first step, so NCCL's watchdog's evidence arrives first; on CPU the groups
outlast the bound, and the controller finds the hung rank itself."""

from __future__ import annotations

import pytest

from services.hang_bounds import STARTUP_GRACE_S, collective_timeout_s, hang_bound_s


@pytest.mark.parametrize("hang_after_s", [2.0, 30.0, 60.0, 600.0, 3600.0])
@pytest.mark.parametrize("stepping", [False, True])
def test_on_cuda_the_groups_give_up_before_the_controller(hang_after_s, stepping):
    bound = hang_bound_s(hang_after_s, stepping)
    assert collective_timeout_s(hang_after_s, cuda=True, stepping=stepping) == bound / 2


def test_the_first_step_gets_the_start_up_grace():
    assert hang_bound_s(60.0, stepping=False) == STARTUP_GRACE_S
    assert collective_timeout_s(60.0, cuda=True, stepping=False) == STARTUP_GRACE_S / 2
    assert collective_timeout_s(60.0, cuda=True, stepping=True) == 30.0


@pytest.mark.parametrize("hang_after_s", [2.0, 30.0, 60.0, 600.0])
def test_on_cpu_the_groups_outlast_the_controller(hang_after_s):
    timeout = collective_timeout_s(hang_after_s, cuda=False, stepping=True)
    assert timeout == max(60.0, hang_after_s) >= hang_bound_s(hang_after_s, stepping=True)
