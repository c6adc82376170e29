"""Admission with the planner (controller/admission.py): a spec that cannot fit is refused with
the nearest layout that does, `parallel.auto` is planned against the pool it is given, and a
job's snapshot rings are held to the room the workers registered for them."""

from __future__ import annotations

import pytest
import yaml

from controller.admission import (
    PoolWorker,
    _plan,
    auto_layout,
    capacity_problems,
    snapshot_problems,
)
from services.planner.snapshot_memory import snapshot_rings
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


def roomy_pool(room_gib: float, devices: int = 1) -> list[PoolWorker]:
    """Two workers whose agents registered `room_gib` for snapshots, and one that said none."""
    known = [
        PoolWorker(f"w{i}", devices, 64 * GiB, "cpu", snapshot_bytes=int(room_gib * GiB))
        for i in range(2)
    ]
    return [*known, PoolWorker("w9", devices, 64 * GiB, "cpu")]


def capacity_plan(s):
    return _plan(s, roomy_pool(1))


def snapshot_spec(**snapshot) -> dict:
    return spec({"dp": 2}, {"preset": "small"}, snapshot=snapshot)


def test_snapshot_rings_larger_than_any_workers_room_are_refused_naming_the_fixes():
    s = parse_spec(snapshot_spec())
    rings = snapshot_rings(s, capacity_plan(s).memory)
    need = rings.per_rank  # one rank per worker
    (problem,) = snapshot_problems(s, roomy_pool(0.9 * need / GiB))
    assert problem.field == "snapshot"
    for fix in (
        "snapshot.full_every: 1",
        "snapshot.buddy: false",
        "--snapshot-dir",
        "snapshot.enabled: false",
    ):
        assert fix in problem.message, problem.message
    assert snapshot_problems(s, roomy_pool(1.1 * need / GiB)) == []


def test_each_named_fix_shrinks_the_rings_and_disabling_them_admits_the_job():
    base = parse_spec(snapshot_spec())
    per_rank = snapshot_rings(base, capacity_plan(base).memory).per_rank
    room = roomy_pool(0.9 * per_rank / GiB)
    for fix in ({"full_every": 1}, {"buddy": False}):
        s = parse_spec(snapshot_spec(**fix))
        assert snapshot_rings(s, capacity_plan(s).memory).per_rank < per_rank, fix
        assert snapshot_problems(s, room) == [], fix
    assert snapshot_problems(parse_spec(snapshot_spec(enabled=False)), room) == []


def test_a_worker_that_registered_no_room_is_not_judged():
    s = parse_spec(snapshot_spec())
    assert snapshot_problems(s, [PoolWorker("w0", 1, 64 * GiB, "cpu")]) == []
