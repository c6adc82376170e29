"""Each replica's submitted dp index across generations (controller/apply.py `dp_labels`),
through the real next-generation layouts of controller/recovery.py: a shrink renumbers the
replicas it keeps from 0, their labels stay; a grow's new replica takes the free label; a
replacement keeps them; a re-planned pp or tp starts over. Stored with the assignment."""

from __future__ import annotations

from controller.apply import dp_labels
from controller.recovery import Layout, grow, replace_workers, shrink
from services.assignment import Assignment
from services.mesh import MeshShape
from tests.unit.test_assignment import stored
from tests.unit.test_recovery import free, mesh

SHAPE = MeshShape(3, 1, 2)  # 6 ranks, one per worker w0..w5: replicas (w0 w1) (w2 w3) (w4 w5)


def generation(n: int, layout: Layout, labels: list[int] | None) -> Assignment:
    return Assignment(
        "j", n, layout.shape, "10.0.0.1", 20001, layout.ranks, layout.spares, dp_labels=labels
    )


def first() -> tuple[Assignment, dict[str, str]]:
    ranks, host_of = mesh(SHAPE, [f"h{i}" for i in range(6)])
    return generation(1, Layout(SHAPE, ranks, 1, {}, []), None), host_of


def test_a_shrink_keeps_the_labels_of_the_replicas_it_renumbers_and_a_grow_takes_the_free_one():
    g1, host_of = first()
    assert g1.labels == [0, 1, 2] and dp_labels(None, Layout(SHAPE, g1.ranks, 1, {}, [])) is None
    # w1 (dp 0) dies: replicas 1 and 2 become dp 0 and 1, still named 1 and 2
    lay = shrink(SHAPE, g1.ranks, {"w1"}, 1, 12, 1, False, host_of)
    assert [r.coord.dp for r in lay.ranks if r.wid == "w2"] == [0]
    g2 = generation(2, lay, dp_labels(g1, lay))
    assert g2.labels == [1, 2]
    # then w5 (dp 1 now, label 2) dies: replica 1 is left, at dp 0
    lay = shrink(g2.shape, g2.ranks, {"w5"}, 1, 12, 1, False, host_of)
    g3 = generation(3, lay, dp_labels(g2, lay))
    assert g3.labels == [1]
    # a grow appends a replica at dp 1: it takes the lowest label free, 0
    lay = grow(g3.shape, g3.ranks, 3, 12, 1, False, free("n0@h9", "n1@h9"), host_of)
    g4 = generation(4, lay, dp_labels(g3, lay))
    assert g4.labels == [1, 0]
    # stored and read back as the agents and the status read it
    assert Assignment.from_fields(stored(g4)).labels == [1, 0]


def test_a_replacement_keeps_every_label_and_a_replan_starts_over():
    g1, host_of = first()
    lay = shrink(SHAPE, g1.ranks, {"w0"}, 1, 12, 1, False, host_of)
    g2 = generation(2, lay, dp_labels(g1, lay))
    assert g2.labels == [1, 2]
    # w2 (dp 0, label 1) is replaced by a spare at the same coordinate: nothing renumbered
    lay = replace_workers(g2.shape, g2.ranks, 1, {"w2"}, free("s0@h9"), [], host_of)
    assert dp_labels(g2, lay) == [1, 2]
    # the same workers re-planned to tp 1: another layout altogether
    replanned = MeshShape(4, 1, 1)
    ranks, _ = mesh(replanned, ["h0"] * 4)
    assert dp_labels(g2, Layout(replanned, ranks, 1, {}, [])) is None


def test_an_assignment_stored_without_labels_reads_as_the_submitted_order():
    g1, _ = first()
    fields = stored(g1)
    assert "dp_labels" not in fields  # an older controller's record reads the same
    assert Assignment.from_fields(fields).labels == [0, 1, 2]


def test_a_replacement_in_a_16k_replica_job_is_labelled_in_linear_time():
    """Per rank, the labels are read once and the labels found are a set: each was a scan
    (16,384 ranks of dp: 5 s of the controller's 7.2 s decide in bench/scale.py, before)."""
    import time

    shape = MeshShape(16384, 1, 1)
    ranks, host_of = mesh(shape, ["h0"] * shape.world_size)
    g1 = generation(1, Layout(shape, ranks, 1, {}, []), None)
    lay = replace_workers(shape, g1.ranks, 1, {"w7"}, free("s0@h9"), [], host_of)
    start = time.perf_counter()
    assert dp_labels(g1, lay) is None  # a replacement keeps every label: the submitted order
    assert time.perf_counter() - start < 2.0  # a sanity bound: linear is ~0.03 s here
