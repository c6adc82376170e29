"""controller/ranks.py `rank_view`: every rank's status from the assignment and the agents'
progress hashes, built once per distinct report and never stale."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from controller.ranks import rank_view
from services.assignment import Assignment, RankEntry
from services.mesh import Coord, MeshShape


def assignment(n: int = 4, generation: int = 2) -> Assignment:
    ranks = [RankEntry(r, f"w{r}", 0, Coord(r, 0, 0)) for r in range(n)]
    return Assignment("j1", generation, MeshShape(n, 1, 1), "127.0.0.1", 29500, ranks)


def progress(asg: Assignment, **by_rank: dict) -> dict[str, dict[str, str]]:
    """Each rank's worker reporting `by_rank['r<rank>']` (default: running at step 1)."""
    return {
        r.wid: {
            "job": asg.job,
            "generation": str(asg.generation),
            "ranks": json.dumps(
                {str(r.rank): by_rank.get(f"r{r.rank}", {"state": "running", "step": 1})}
            ),
        }
        for r in asg.ranks
    }


def test_a_new_report_is_seen_at_once():
    asg = assignment()
    before = rank_view(asg, progress(asg))
    after = rank_view(asg, progress(asg, r2={"state": "running", "step": 7, "loss": 2.5}))
    assert [r.step for r in before] == [1, 1, 1, 1]
    assert [(r.step, r.loss) for r in after] == [(1, None), (1, None), (7, 2.5), (1, None)]


def test_unchanged_reports_are_not_built_again():
    asg = assignment()
    first = rank_view(asg, progress(asg))
    again = rank_view(asg, progress(asg, r3={"state": "running", "step": 2}))
    assert [a is b for a, b in zip(first, again, strict=True)] == [True, True, True, False]


def test_a_rank_on_a_silent_worker_is_lost_unless_it_ended():
    asg = assignment()
    p = progress(asg, r1={"state": "succeeded", "step": 9})
    view = rank_view(asg, p, alive={"w2", "w3"})
    assert [r.state for r in view] == ["lost", "succeeded", "running", "running"]
    assert [r.state for r in rank_view(asg, p)] == ["running", "succeeded", "running", "running"]


def test_reports_of_another_generation_count_as_none():
    asg = assignment(generation=3)
    stale = progress(assignment(generation=2), r0={"state": "running", "step": 40})
    assert [(r.state, r.step) for r in rank_view(asg, stale)] == [("assigned", 0)] * 4


def test_a_malformed_report_counts_as_none_and_stops_no_other():
    asg = assignment()
    p = progress(asg, r1={"state": "running", "step": "many"})
    p["w3"]["ranks"] = "{not json"
    view = rank_view(asg, p)
    assert [(r.state, r.step) for r in view] == [
        ("running", 1),
        ("assigned", 0),
        ("running", 1),
        ("assigned", 0),
    ]


def test_statuses_are_shared_so_they_cannot_be_changed():
    asg = assignment()
    r = rank_view(asg, progress(asg))[0]
    with pytest.raises(ValidationError):
        r.state = "straggler"
    assert r.model_copy(update={"state": "straggler"}).state == "straggler"
    assert (r.rank, r.worker, r.coord.dp, r.local_rank) == (0, "w0", 0, 0)
