"""The next generation's layout (controller/recovery.py): which worker's ranks move where,
the coordinates and rank numbers after a shrink or a grow, the microbatch count that keeps
the global batch, and None whenever the layout is impossible."""

from __future__ import annotations

from controller.placement import FreeWorker, place
from controller.recovery import (
    Layout,
    fit_microbatches,
    grow,
    replace_workers,
    shrink,
    with_local_world,
)
from services.assignment import RankEntry
from services.mesh import Coord, MeshShape


def mesh(shape: MeshShape, hosts: list[str]) -> tuple[list[RankEntry], dict[str, str]]:
    """One rank per worker w0, w1, ... in rank order; worker i on hosts[i]."""
    ranks = [RankEntry(i, f"w{i}", 0, shape.coord(i)) for i in range(shape.world_size)]
    return ranks, {f"w{i}": h for i, h in enumerate(hosts)}


def free(*specs: str, slots: int = 1) -> list[FreeWorker]:
    """'s1@h1' -> worker s1 on host h1."""
    return [FreeWorker(s.split("@")[0], s.split("@")[1], "10.0.0.1", slots) for s in specs]


def placed(layout: Layout) -> list[tuple[int, str, tuple[int, int, int]]]:
    return [(r.rank, r.wid, tuple(r.coord)) for r in layout.ranks]


# -- fit_microbatches -----------------------------------------------------------------
def test_fit_keeps_the_wanted_count_when_it_divides_the_share():
    assert fit_microbatches(12, 2, 1, 3, False) == 3  # share 6


def test_fit_raises_the_count_to_the_next_divisor_of_the_share():
    assert fit_microbatches(12, 2, 1, 4, False) == 6  # share 6: 4 and 5 do not divide it


def test_fit_needs_at_least_pp_microbatches_with_pipelining():
    assert fit_microbatches(16, 2, 4, 1, False) == 4  # share 8: 1, 2 < pp


def test_fit_interleaved_needs_a_multiple_of_pp():
    assert fit_microbatches(24, 2, 4, 5, True) == 12  # share 12: 6 divides it, not a multiple of 4


def test_fit_is_none_when_dp_does_not_divide_the_global_batch():
    assert fit_microbatches(12, 5, 1, 1, False) is None


def test_fit_is_none_when_the_share_is_smaller_than_pp():
    assert fit_microbatches(4, 2, 4, 1, False) is None  # share 2 < 4 stages


# -- with_local_world -----------------------------------------------------------------
def test_local_world_counts_the_ranks_on_each_host():
    ranks, _ = mesh(MeshShape(3, 1, 1), ["a", "a", "b"])
    out = with_local_world(ranks, {"w0": "a", "w1": "a", "w2": "b"})
    assert [r.local_world_size for r in out] == [2, 2, 1]


def test_local_world_of_a_worker_without_a_host_is_its_own():
    ranks, _ = mesh(MeshShape(2, 1, 1), ["a", "a"])
    assert [r.local_world_size for r in with_local_world(ranks, {})] == [1, 1]


# -- replace_workers ------------------------------------------------------------------
def test_replace_moves_the_bad_workers_ranks_to_the_same_coordinates():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "b"])
    layout = replace_workers(shape, ranks, 1, {"w1"}, free("s1@c"), [], host_of)
    assert placed(layout) == [(0, "w0", (0, 0, 0)), (1, "s1", (1, 0, 0))]
    assert layout.moved == {"w1": "s1"} and layout.shape == shape and layout.microbatches == 1


def test_replace_prefers_a_candidate_on_the_bad_workers_host():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "b"])
    layout = replace_workers(shape, ranks, 1, {"w1"}, free("s1@c", "s2@b"), [], host_of)
    assert layout.moved == {"w1": "s2"}


def test_replace_takes_candidates_in_order_for_several_bad_workers():
    shape = MeshShape(3, 1, 1)
    ranks, host_of = mesh(shape, ["a", "a", "a"])
    layout = replace_workers(shape, ranks, 1, {"w0", "w2"}, free("s1@x", "s2@y"), [], host_of)
    assert layout.moved == {"w0": "s1", "w2": "s2"}
    assert [r.wid for r in layout.ranks] == ["s1", "w1", "s2"]


def test_replace_needs_a_candidate_with_slots_for_all_the_workers_ranks():
    shape = MeshShape(1, 1, 2)
    ranks = [RankEntry(0, "w0", 0, Coord(0, 0, 0)), RankEntry(1, "w0", 1, Coord(0, 0, 1))]
    small, big = free("s1@a")[0], free("s2@b", slots=2)[0]
    layout = replace_workers(shape, ranks, 1, {"w0"}, [small, big], [], {"w0": "a"})
    assert layout.moved == {"w0": "s2"} and [r.local_rank for r in layout.ranks] == [0, 1]
    assert replace_workers(shape, ranks, 1, {"w0"}, [small], [], {"w0": "a"}) is None


def test_replace_keeps_the_unused_spares_and_drops_the_promoted_one():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    layout = replace_workers(shape, ranks, 1, {"w1"}, free("s1@a", "s2@a"), ["s1", "s2"], host_of)
    assert layout.moved == {"w1": "s1"} and layout.spares == ["s2"]


def test_replace_counts_the_new_workers_host_in_the_local_world():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    layout = replace_workers(shape, ranks, 1, {"w1"}, free("s1@b"), [], host_of)
    assert [r.local_world_size for r in layout.ranks] == [1, 1]


def test_replace_is_none_without_enough_candidates():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    assert replace_workers(shape, ranks, 1, {"w0", "w1"}, free("s1@a"), [], host_of) is None


def test_replace_with_no_bad_worker_restarts_the_same_layout():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    layout = replace_workers(shape, ranks, 1, set(), [], [], host_of)
    assert layout.moved == {} and [r.wid for r in layout.ranks] == ["w0", "w1"]


# -- shrink ---------------------------------------------------------------------------
def test_shrink_drops_the_replica_that_lost_a_rank_and_renumbers():
    shape = MeshShape(3, 2, 1)  # ranks 0,1 dp0; 2,3 dp1; 4,5 dp2
    ranks, host_of = mesh(shape, ["a"] * 6)
    layout = shrink(shape, ranks, {"w3"}, 1, 12, 2, False, host_of)
    assert layout.shape == MeshShape(2, 2, 1)
    assert placed(layout) == [
        (0, "w0", (0, 0, 0)),
        (1, "w1", (0, 1, 0)),
        (2, "w4", (1, 0, 0)),
        (3, "w5", (1, 1, 0)),
    ]
    assert layout.spares == ["w2"]  # the dropped replica's healthy member stays as a spare
    assert layout.moved == {} and layout.microbatches == 2  # share 6: 2 still divides it
    assert {r.local_world_size for r in layout.ranks} == {4}


def test_shrink_raises_microbatches_to_keep_the_global_batch():
    shape = MeshShape(4, 1, 1)
    ranks, host_of = mesh(shape, ["a"] * 4)
    layout = shrink(shape, ranks, {"w0"}, 1, 16, 4, False, host_of)
    # 3 replicas do not divide 16
    assert layout is None
    layout = shrink(shape, ranks, {"w0", "w1"}, 1, 16, 4, False, host_of)
    assert layout.shape.dp == 2 and layout.microbatches == 4  # share 8
    layout = shrink(MeshShape(2, 1, 1), ranks[:2], {"w0"}, 1, 12, 4, False, host_of)
    assert layout.shape.dp == 1 and layout.microbatches == 4  # share 12: 4 divides it


def test_shrink_is_none_below_min_dp():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    assert shrink(shape, ranks, {"w1"}, 2, 4, 1, False, host_of) is None


def test_shrink_is_none_when_every_replica_lost_a_rank():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    assert shrink(shape, ranks, {"w0", "w1"}, 1, 4, 1, False, host_of) is None


# -- grow -----------------------------------------------------------------------------
def test_grow_adds_one_replica_at_the_next_dp_index():
    shape = MeshShape(1, 2, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    layout = grow(shape, ranks, 2, 8, 2, False, free("s1@b", "s2@b"), host_of)
    assert layout.shape == MeshShape(2, 2, 1)
    assert placed(layout) == [
        (0, "w0", (0, 0, 0)),
        (1, "w1", (0, 1, 0)),
        (2, "s1", (1, 0, 0)),
        (3, "s2", (1, 1, 0)),
    ]
    assert layout.microbatches == 2 and layout.spares == [] and layout.moved == {}
    assert [r.local_world_size for r in layout.ranks] == [2, 2, 2, 2]


def test_grow_renumbers_existing_ranks_for_the_new_shape():
    shape = MeshShape(1, 1, 2)
    ranks = [RankEntry(0, "w0", 0, Coord(0, 0, 0)), RankEntry(1, "w0", 1, Coord(0, 0, 1))]
    layout = grow(shape, ranks, 3, 6, 1, False, free("s1@b", slots=2), {"w0": "a"})
    assert placed(layout) == [
        (0, "w0", (0, 0, 0)),
        (1, "w0", (0, 0, 1)),
        (2, "s1", (1, 0, 0)),
        (3, "s1", (1, 0, 1)),
    ]


def test_grow_is_none_at_the_target_dp():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    assert grow(shape, ranks, 2, 4, 1, False, free("s1@a"), host_of) is None


def test_grow_is_none_without_a_whole_replica_of_free_workers():
    shape = MeshShape(1, 2, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    assert grow(shape, ranks, 2, 8, 2, False, free("s1@b"), host_of) is None


def test_grow_is_none_when_the_new_dp_does_not_divide_the_global_batch():
    shape = MeshShape(2, 1, 1)
    ranks, host_of = mesh(shape, ["a", "a"])
    assert grow(shape, ranks, 3, 4, 1, False, free("s1@b"), host_of) is None


def test_grow_places_the_replica_as_placement_would():
    shape = MeshShape(1, 1, 2)
    replica = place(MeshShape(1, 1, 2), 0, free("s1@b", "s2@c", "s3@c"))
    layout = grow(
        shape,
        [RankEntry(0, "w0", 0, Coord(0, 0, 0)), RankEntry(1, "w1", 0, Coord(0, 0, 1))],
        2,
        4,
        1,
        False,
        free("s1@b", "s2@c", "s3@c"),
        {"w0": "a", "w1": "a"},
    )
    assert [r.wid for r in layout.ranks[2:]] == [r.wid for r in replica.ranks] == ["s2", "s3"]
