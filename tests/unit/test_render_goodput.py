"""cli/render.py: the goodput ledger as `meshkeeper status JOB` prints it, one line."""

from __future__ import annotations

import io

from cli import render
from services import api
from tests.unit.test_render_eval import status

PHASES = api.RecoveryPhases(
    detect_s=1.0, decide_s=0.5, rendezvous_s=2.0, restore_s=1.5, first_step_s=1.0
)


def ledger(**parts: float) -> api.Goodput:
    everything = {p: parts.get(p, 0.0) for p in api.GoodputParts.model_fields}
    wall = sum(everything.values())
    usable = wall - everything["suspended_s"]
    return api.Goodput(
        wall_s=wall,
        ettr=everything["productive_s"] / usable,
        parts=api.GoodputParts(**everything),
        recovery_phases=PHASES,
    )


def test_each_part_is_its_share_of_the_wall_time_and_empty_ones_are_left_out():
    g = ledger(productive_s=3000.0, recovery_s=6.0, waiting_s=594.0, checkpoint_s=3.0)
    assert render.goodput(g).plain == (
        "goodput: ettr 0.83  productive 83% recovery <1% checkpoint <1% waiting 16%  of 1:00:03"
    )


def test_the_line_is_in_the_jobs_detail_once_it_has_a_ledger():
    job = status(step=3, steps=10, goodput=ledger(productive_s=9.0, suspended_s=1.0).model_dump())
    out = io.StringIO()  # not a terminal: plain text
    render.console(out).print(render.job_detail(job))
    assert "  goodput: ettr 1.00  productive 90% suspended 10%  of 0:10\n" in out.getvalue()
