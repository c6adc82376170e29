"""The assignment record survives its trip through a Redis hash (services/assignment.py):
what the controller writes is what the agents read back."""

from __future__ import annotations

import pytest

from services.assignment import Assignment, RankEntry
from services.mesh import MeshShape
from services.store import flat

SHAPE = MeshShape(2, 1, 2)
RANKS = [RankEntry(r, f"w{r}", 0, SHAPE.coord(r), 2) for r in range(4)]


def stored(asg: Assignment) -> dict[str, str]:
    """The hash as Redis returns it: every value a string, None fields absent."""
    return flat(asg.to_fields())


def test_hot_recovery_fields_round_trip_with_integer_ranks():
    asg = Assignment(
        "j",
        5,
        SHAPE,
        "10.0.0.1",
        20001,
        RANKS,
        ["s0"],
        buddies={0: 2, 1: 3, 2: 0, 3: 1},
        restore_generation=4,
        restore_sources={0: 0, 1: 3, 2: 2, 3: 3},
    )
    assert Assignment.from_fields(stored(asg)) == asg


def test_without_snapshots_nothing_is_written_and_a_record_without_them_reads_as_defaults():
    asg = Assignment("j", 1, SHAPE, "10.0.0.1", 20001, RANKS)
    fields = stored(asg)
    assert "buddies" not in fields and "restore" not in fields
    back = Assignment.from_fields(fields)
    assert back == asg and (back.buddies, back.restore_sources) == ({}, None)


@pytest.mark.parametrize("name", ["buddies", "restore"])
def test_a_malformed_hot_recovery_field_reads_as_no_record(name):
    fields = {**stored(Assignment("j", 1, SHAPE, "10.0.0.1", 20001, RANKS)), name: "[1]"}
    assert Assignment.from_fields(fields) is None
