"""A CUDA allocator out of memory (worker/trainer/oom.py): the rank exits with code 5 and a
message that sets its peak against the planner's estimate for its layout, on the device's
real memory, and names the fix."""

from __future__ import annotations

import pytest

from tests.launch import run_trainer
from tests.stack import tiny_spec

pytestmark = pytest.mark.gpu


def test_a_cuda_out_of_memory_exits_5_with_the_plan_and_the_fix(tmp_path):
    spec = tiny_spec("gpu-oom", parallel={"dp": 1}, train={"steps": 4})
    spec["chaos"] = {"device_oom": [{"rank": 0, "step": 2}]}
    with pytest.raises(AssertionError) as failed:
        run_trainer(spec, tmp_path, timeout=300)
    report = str(failed.value)
    assert "[rankrun] rank 0 exited with 5" in report, report[-3000:]
    assert "out of memory on cuda:0 (CUDA out of memory." in report, report[-3000:]
    assert "the planner's estimate for dp=1 pp=1 tp=1 zero=3: " in report, report[-3000:]
    assert "GiB per rank" in report and "parallel.zero 3" in report, report[-3000:]
