"""Where snapshot copies live and where a new generation restores from (services/buddies.py)."""

from __future__ import annotations

from services.assignment import Assignment, RankEntry
from services.buddies import pick_holders, restore_sources
from services.mesh import MeshShape


def world(shape: MeshShape, wid_of) -> list[RankEntry]:
    """One RankEntry per rank, on the worker `wid_of(rank)` names."""
    return [RankEntry(r, wid_of(r), 0, shape.coord(r)) for r in range(shape.world_size)]


def assignment(shape: MeshShape, ranks: list[RankEntry], buddies: dict[int, int]) -> Assignment:
    return Assignment("j", 4, shape, "10.0.0.1", 20000, ranks, buddies=buddies)


# -- pick_holders ---------------------------------------------------------------------------
def test_the_next_replica_holds_each_rank_when_it_is_on_another_host():
    shape = MeshShape(3, 1, 2)  # one replica (a TP pair) per host
    ranks = world(shape, lambda r: f"w{r}")
    host_of = {f"w{r}": f"h{r // 2}" for r in range(6)}
    assert pick_holders(ranks, shape, host_of) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}


def test_without_a_next_replica_elsewhere_the_next_rank_on_another_host_holds_it():
    # dp 1, pp 2, tp 2: stage 0 on host a, stage 1 on host b
    shape = MeshShape(1, 2, 2)
    ranks = world(shape, lambda r: f"w{r}")
    host_of = {"w0": "a", "w1": "a", "w2": "b", "w3": "b"}
    assert pick_holders(ranks, shape, host_of) == {0: 2, 1: 2, 2: 0, 3: 0}


def test_on_one_host_the_next_replica_on_another_worker_holds_it():
    shape = MeshShape(2, 1, 2)
    ranks = world(shape, lambda r: f"w{r // 2}")  # two workers of two devices each
    assert pick_holders(ranks, shape, {"w0": "a", "w1": "a"}) == {0: 2, 1: 3, 2: 0, 3: 1}


def test_on_one_host_without_a_next_replica_the_next_rank_on_another_worker_holds_it():
    shape = MeshShape(1, 1, 4)
    ranks = world(shape, lambda r: f"w{r // 2}")  # one TP group over two workers
    assert pick_holders(ranks, shape, {"w0": "a", "w1": "a"}) == {0: 2, 1: 2, 2: 0, 3: 0}


def test_a_rank_on_the_next_replicas_host_looks_further_for_another_host():
    # dp 3 on two hosts: replicas 0 and 1 share host a, so rank 0's mirror (rank 1) does not do
    shape = MeshShape(3, 1, 1)
    ranks = world(shape, lambda r: f"w{r}")
    host_of = {"w0": "a", "w1": "a", "w2": "b"}
    assert pick_holders(ranks, shape, host_of) == {0: 2, 1: 2, 2: 0}


def test_a_single_worker_job_has_no_buddy():
    shape = MeshShape(1, 1, 4)
    ranks = world(shape, lambda r: "w0")
    assert pick_holders(ranks, shape, {"w0": "a"}) == {}


def test_in_a_big_world_every_rank_is_held_on_the_next_host():
    # 4,096 ranks, 8 per host, at dp 1: no next replica, so the next host's first rank
    shape = MeshShape(1, 512, 8)
    ranks = world(shape, lambda r: f"w{r}")
    host_of = {f"w{r}": f"h{r // 8}" for r in range(shape.world_size)}
    holders = pick_holders(ranks, shape, host_of)
    assert holders == {r: (r // 8 + 1) % 512 * 8 for r in range(shape.world_size)}


# -- restore_sources ------------------------------------------------------------------------
SHAPE = MeshShape(2, 1, 2)
OLD_RANKS = world(SHAPE, lambda r: f"w{r}")
OLD = assignment(SHAPE, OLD_RANKS, {0: 2, 1: 3, 2: 0, 3: 1})


def test_a_restart_in_place_restores_every_rank_from_its_own_snapshot():
    assert restore_sources(OLD, OLD_RANKS, SHAPE) == {0: 0, 1: 1, 2: 2, 3: 3}


def test_a_restart_in_place_needs_no_buddies():
    old = assignment(SHAPE, OLD_RANKS, {})
    assert restore_sources(old, OLD_RANKS, SHAPE) == {0: 0, 1: 1, 2: 2, 3: 3}


def test_a_replaced_rank_restores_from_its_holder():
    new = world(SHAPE, lambda r: "s0" if r == 1 else f"w{r}")
    assert restore_sources(OLD, new, SHAPE) == {0: 0, 1: 3, 2: 2, 3: 3}


def test_a_holder_that_moved_ranks_is_found_on_its_worker():
    # w3 held rank 1's copy and now runs rank 2; w0 held the copies of ranks 2 and 3
    new = [
        RankEntry(0, "w0", 0, SHAPE.coord(0)),
        RankEntry(1, "s0", 0, SHAPE.coord(1)),
        RankEntry(2, "w3", 0, SHAPE.coord(2)),
        RankEntry(3, "s1", 0, SHAPE.coord(3)),
    ]
    old = assignment(SHAPE, OLD_RANKS, {0: 2, 1: 3, 2: 0, 3: 0})
    assert restore_sources(old, new, SHAPE) == {0: 0, 1: 2, 2: 0, 3: 0}


def test_a_shrink_restores_from_disk():
    shrunk = MeshShape(1, 1, 2)
    assert restore_sources(OLD, world(shrunk, lambda r: f"w{r}"), shrunk) is None


def test_a_rank_whose_copy_left_with_its_holder_sends_the_world_to_disk():
    # ranks 1 and 3 (each other's holders) both lost their workers: a whole-host loss with
    # both copies on it
    old = assignment(SHAPE, OLD_RANKS, {0: 2, 1: 3, 2: 0, 3: 1})
    new = world(SHAPE, lambda r: f"s{r}" if r in (1, 3) else f"w{r}")
    assert restore_sources(old, new, SHAPE) is None


def test_a_moved_rank_without_buddies_sends_the_world_to_disk():
    old = assignment(SHAPE, OLD_RANKS, {})
    new = world(SHAPE, lambda r: "s0" if r == 1 else f"w{r}")
    assert restore_sources(old, new, SHAPE) is None
