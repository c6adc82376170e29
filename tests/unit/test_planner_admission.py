"""Admission with the planner (controller/admission.py): a spec that cannot fit is refused with
the nearest layout that does, and `parallel.auto` is planned against the pool it is given."""

from __future__ import annotations

import pytest
import yaml

from controller.admission import PoolWorker, auto_layout, capacity_problems
from services.spec import SpecError, parse_spec

GiB = 2**30


def pool(n: int, memory_gib: float = 16, devices: int = 1) -> list[PoolWorker]:
    return [PoolWorker(f"w{i}", devices, int(memory_gib * GiB), "cpu") for i in range(n)]


def spec(parallel: dict, model: dict | None = None, **extra) -> dict:
    return {
        "name": "p",
        "model": model or {"preset": "1b"},
        "parallel": parallel,
        "train": {"steps": 1, "global_batch": 8},
        **extra,
    }


def test_a_rank_too_big_is_refused_with_the_nearest_layout_that_fits():
    problems = capacity_problems(parse_spec(spec({"dp": 1})), pool(8))
    assert [p.field for p in problems] == ["model.preset"]
    msg = problems[0].message
    assert "raise parallel.tp or parallel.pp" in msg, msg
    nearest = msg.split("the nearest layout that fits: parallel: ")[1]
    # it is a layout the spec checks accept, and it fits: admission takes it
    fixed = parse_spec(spec(yaml.safe_load(nearest)))
    assert capacity_problems(fixed, pool(8)) == []


def test_auto_takes_the_planners_best_layout_within_the_pool_and_its_spares():
    s = parse_spec(spec({"auto": True}, {"preset": "tiny"}, fault_tolerance={"spares": 1}))
    planned = auto_layout(s, pool(4), max_ranks=None)
    p = planned.parallel
    assert not p.auto and p.world_size <= 3  # one of the 4 workers stays a spare
    assert parse_spec(planned.model_dump(mode="json")) == planned  # a valid spec as stored


def test_auto_respects_the_owners_quota():
    s = parse_spec(spec({"auto": True}, {"preset": "tiny"}))
    assert auto_layout(s, pool(8), max_ranks=2).parallel.world_size <= 2


def test_auto_with_nothing_that_fits_says_what_the_smallest_layout_needs():
    s = parse_spec(spec({"auto": True}, {"preset": "70b"}))
    with pytest.raises(SpecError) as e:
        auto_layout(s, pool(2, memory_gib=4), max_ranks=None)
    (problem,) = e.value.problems
    assert problem.field == "model.preset" and "the smallest layout needs" in problem.message


def test_auto_without_live_workers_names_the_field():
    s = parse_spec(spec({"auto": True}, {"preset": "tiny"}))
    with pytest.raises(SpecError) as e:
        auto_layout(s, [], max_ranks=None)
    assert [p.field for p in e.value.problems] == ["parallel.auto"]
