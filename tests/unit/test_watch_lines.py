"""`meshkeeper watch` (and the demo) in a pipe (cli/watch.py `LogLines`): each step's line at
most once, with that step's loss, however the ETA, the speed or the phase change between
polls (the demo printed step 12 twice); a phase change is a line of its own."""

from __future__ import annotations

import io

import pytest

from cli import render, watch
from tests.unit.test_render_eval import status


@pytest.fixture
def lines(monkeypatch):
    monkeypatch.setattr(watch, "LOG_EVERY_S", -1.0)  # every poll due: only the step decides
    out = io.StringIO()
    view = watch.LogLines(render.console(out))
    return view, out


def test_each_step_is_printed_once_with_its_own_loss(lines):
    view, out = lines
    polls = [
        status(step=12, loss=3.5, tokens_per_s=1000.0),
        status(step=12, loss=3.5, tokens_per_s=980.0, eta_s=253.0),  # a new speed, same step
        status(step=12, loss=3.5, phase="Recovering"),  # a rank killed at step 12
        status(step=12, loss=3.5, phase="Running", eta_s=626.0),  # resumed below it
        status(step=13, loss=3.4, eta_s=285.0),
        status(step=15, loss=3.2),
        status(step=15, loss=3.2, phase="Succeeded"),
    ]
    for j in polls:
        view.show(j)
    printed = out.getvalue().splitlines()
    # the phase changes get lines of their own, which are no step's
    assert [line.split(": ")[1] for line in printed if not line.startswith("step")] == [
        "Recovering",
        "Running",
    ]
    printed = [line for line in printed if line.startswith("step")]
    assert [line.split("  ")[:2] for line in printed] == [
        ["step 12/100", "loss 3.5000"],
        ["step 13/100", "loss 3.4000"],
        ["step 15/100", "loss 3.2000"],
    ]
