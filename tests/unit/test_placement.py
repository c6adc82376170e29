"""Placement (controller/placement.py): TP groups on one host where host labels allow, DP
outermost, spares held back as whole workers, and no placement when capacity is short."""

from __future__ import annotations

from controller.placement import FreeWorker, natural_key, place
from services.mesh import MeshShape


def pool(hosts: dict[str, int], slots: int = 1) -> list[FreeWorker]:
    out = []
    for h, n in hosts.items():
        out += [FreeWorker(f"{h}-w{i}", h, f"10.0.0.{len(out) + 1}", slots) for i in range(n)]
    return out


def hosts_of(placement, workers):
    host = {w.wid: w.host for w in workers}
    return [host[r.wid] for r in placement.ranks]


def test_every_tp_group_shares_a_host():
    workers = pool({"a": 4, "b": 4})
    p = place(MeshShape(2, 2, 2), 0, workers)
    hosts = hosts_of(p, workers)
    for first in range(0, 8, 2):
        assert hosts[first] == hosts[first + 1]
    assert not p.tp_split
    assert [r.rank for r in p.ranks] == list(range(8))
    assert [tuple(r.coord) for r in p.ranks][:3] == [(0, 0, 0), (0, 0, 1), (0, 1, 0)]
    assert {r.local_world_size for r in p.ranks} == {4}


def test_odd_hosts_keep_tp_groups_whole():
    # 3 + 2 + 3 slots for three TP groups of 2: filling hosts in order would put ranks 2
    # and 3 on a and b; every group fits whole on some host, so none may straddle
    workers = pool({"a": 3, "b": 2, "c": 3})
    p = place(MeshShape(1, 3, 2), 0, workers)
    hosts = hosts_of(p, workers)
    assert all(hosts[i] == hosts[i + 1] for i in range(0, 6, 2)), hosts
    assert not p.tp_split


def test_tp_group_split_only_when_no_host_has_room():
    workers = pool({"a": 1, "b": 1})
    p = place(MeshShape(1, 1, 2), 0, workers)
    assert p.tp_split and len({r.wid for r in p.ranks}) == 2


def test_multi_device_worker_takes_a_whole_tp_group():
    workers = pool({"a": 2}, slots=4)
    p = place(MeshShape(2, 1, 4), 0, workers)
    assert [r.wid for r in p.ranks] == ["a-w0"] * 4 + ["a-w1"] * 4
    assert [r.local_rank for r in p.ranks] == [0, 1, 2, 3] * 2


def test_spares_are_whole_workers_held_back():
    workers = pool({"a": 5})
    p = place(MeshShape(2, 1, 1), 3, workers)
    assert p.spares == ["a-w2", "a-w3", "a-w4"]
    assert {r.wid for r in p.ranks}.isdisjoint(p.spares)
    assert len(p.workers) == 5


def test_no_placement_without_capacity():
    assert place(MeshShape(2, 2, 2), 0, pool({"a": 7})) is None
    assert place(MeshShape(2, 1, 1), 1, pool({"a": 2})) is None  # the spare does not fit
    assert place(MeshShape(1, 1, 1), 3, pool({"a": 2})) is None


def test_workers_are_taken_in_name_order():
    assert sorted(["w10", "w2", "w1"], key=natural_key) == ["w1", "w2", "w10"]


def test_a_group_goes_to_the_tightest_host_that_fits():
    # best fit: the 2-slot host b takes the group, leaving host a's 3 slots whole
    workers = pool({"a": 3, "b": 2})
    p = place(MeshShape(1, 1, 2), 0, workers)
    assert hosts_of(p, workers) == ["b", "b"] and p.spares == []


def test_spares_come_from_the_end_of_the_pool_and_ranks_from_the_front():
    workers = pool({"a": 3})
    p = place(MeshShape(1, 1, 1), 2, workers)
    assert [r.wid for r in p.ranks] == ["a-w0"] and p.spares == ["a-w1", "a-w2"]
    assert p.workers == ["a-w0", "a-w1", "a-w2"]


def test_natural_key_orders_numbers_within_names():
    names = ["node10-w1", "node2-w10", "node2-w9", "node1"]
    assert sorted(names, key=natural_key) == ["node1", "node2-w9", "node2-w10", "node10-w1"]
