"""Re-planning on shrink (controller/replan.py): when dp cannot drop, the planner's fastest
layout on the job's healthy workers that a new generation can switch to: zero, schedule,
virtual stages and checkpointing kept, dp at least min_dp, placed on the healthy workers in
order with the rest kept as spares; None when nothing fits or experts are split."""

from __future__ import annotations

import dataclasses

from controller.admission import PoolWorker, pool_cluster
from controller.placement import FreeWorker
from controller.replan import replan, switchable
from services import planner
from services.spec import parse_spec

GiB = 2**30


def spec(parallel: dict, min_dp: int = 2, model: dict | None = None) -> object:
    return parse_spec(
        {
            "name": "r",
            "model": model or {"preset": "tiny"},
            "parallel": parallel,
            "train": {"steps": 10, "global_batch": 8},
            "fault_tolerance": {"spares": 0, "min_dp": min_dp},
        }
    )


def healthy(n: int, slots: int = 1) -> list[FreeWorker]:
    return [FreeWorker(f"w{i}", f"h{i}", "10.0.0.1", slots) for i in range(n)]


def cluster(n: int, memory_gib: float = 16, devices: int = 1) -> planner.Cluster:
    return pool_cluster(
        [PoolWorker(f"w{i}", devices, int(memory_gib * GiB), "cpu") for i in range(n)]
    )


def test_dp2_pp2_on_three_workers_keeps_dp_and_drops_the_pipeline():
    s = spec({"dp": 2, "pp": 2, "microbatches": 2, "zero": 2})
    layout = replan(s, healthy(3), cluster(3))
    assert layout is not None
    assert (layout.shape.dp, layout.shape.pp, layout.shape.tp) == (2, 1, 1)
    assert [r.wid for r in layout.ranks] == ["w0", "w1"]  # the job's own ranks first
    assert layout.spares == ["w2"]
    assert 8 % (2 * layout.microbatches) == 0  # the global batch still splits


def test_the_plan_keeps_what_a_generation_cannot_change():
    s = spec({"dp": 2, "pp": 2, "microbatches": 4, "zero": 3, "activation_checkpointing": True})
    for plan in planner.search(s, cluster(3)):
        lay = plan.layout
        if switchable(s, lay):
            assert (lay.zero, lay.activation_checkpointing) == (3, True)
            assert lay.dp >= 2
    other_zero = dataclasses.replace(planner.Layout.of(s.parallel), pp=1, zero=2)
    assert not switchable(s, other_zero)


def test_an_interleaved_schedule_is_kept_or_the_job_waits():
    s = spec(
        {
            "dp": 2,
            "pp": 2,
            "microbatches": 2,
            "pp_schedule": "interleaved_1f1b",
            "virtual_stages": 2,
            "zero": 2,
        }
    )
    layout = replan(s, healthy(3), cluster(3))
    assert layout is None  # pp 1 would drop the virtual stages; pp 2 needs 4 workers


def test_nothing_below_min_dp():
    s = spec({"dp": 2, "pp": 2, "microbatches": 2, "zero": 2}, min_dp=2)
    assert replan(s, healthy(1), cluster(1)) is None  # dp 1 would fit one worker
    assert (
        replan(
            spec({"dp": 2, "pp": 2, "microbatches": 2, "zero": 2}, min_dp=1), healthy(1), cluster(1)
        )
        is not None
    )


def test_nothing_that_does_not_fit_memory():
    s = spec({"dp": 2, "pp": 2, "microbatches": 2, "zero": 2}, model={"preset": "1b"})
    assert replan(s, healthy(3), cluster(3, memory_gib=1)) is None


def test_jobs_with_experts_split_keep_waiting():
    moe = {"preset": "tiny", "experts": 4}
    s = spec({"dp": 2, "ep": 2, "zero": 2}, model=moe)
    assert replan(s, healthy(3), cluster(3)) is None
