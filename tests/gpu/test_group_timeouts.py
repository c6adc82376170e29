"""On CUDA every process group starts with half the start-up grace (for the model's size) as
its timeout and is
shortened to half of `hang_after_s` once the first step is done (services/hang_bounds.py), so
NCCL's watchdog always acts before the controller's hang bound: read back from the groups
of a real 1-rank trainer."""

from __future__ import annotations

import pytest

from services.hang_bounds import startup_grace_s
from services.spec import parse_spec
from tests.launch import read_records, train
from tests.stack import tiny_spec

pytestmark = pytest.mark.gpu

HANG_AFTER_S = 40.0


def test_the_groups_are_shortened_after_the_first_step(tmp_path):
    spec = tiny_spec(
        "gpu-timeouts",
        parallel={"dp": 1},
        train={"steps": 3},
        fault_tolerance={"hang_after_s": HANG_AFTER_S},
    )
    train(spec, tmp_path, timeout=300)
    groups = [r["timeout_s"] for r in read_records(tmp_path) if r.get("event") == "groups"]
    # the checkpoint's own group is made at the first save, after step 1: already shortened
    made_later = [g for g in groups if "world" not in g]
    assert all(set(g.values()) == {HANG_AFTER_S / 2} for g in made_later), made_later
    first, steady = [g for g in groups if "world" in g]
    grace = startup_grace_s(parse_spec(spec).model.params)
    assert all(t == pytest.approx(grace / 2, abs=1e-3) for t in first.values()), first
    assert set(steady.values()) == {HANG_AFTER_S / 2}, steady
    assert set(first) == set(steady) >= {"world", "dp", "pp", "tp"}
