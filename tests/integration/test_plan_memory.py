"""The planner's per-rank memory against the trainer's measured peak (`peak_mem_bytes`: VmHWM
on CPU), within 15%, on the numerics parity layouts: zero 0/2/3, the three pipeline schedules,
tp and AC. The runs are the session's `uninterrupted` reference runs of those exact specs, so a
suite that trains them too pays once. Rank 0 only (the first pipeline stage): that is the rank
whose records a standalone run keeps; bench/planner_memory.py compares every rank."""

from __future__ import annotations

import copy

import pytest

from services.planner import Layout, cluster
from services.planner.memory import memory_at
from services.spec import parse_spec
from tests.numerics.test_parity import BASE, LAYOUTS

TOLERANCE = 0.15
CPU = cluster("cpu", 8, 1, 2**40)  # memory is measured here, not limited


def covering(layouts: dict[str, dict]) -> list[str]:
    """One parity layout per behaviour the memory model distinguishes (names may change; what
    each layout does is what selects it)."""
    wanted = {
        "zero0": lambda p: p.get("dp", 1) > 1 and p.get("zero") == 0,
        "zero2": lambda p: p.get("dp", 1) > 1 and p.get("zero") == 2,
        "zero3": lambda p: p.get("dp", 1) > 1 and p.get("zero", 3) == 3 and p.get("pp", 1) == 1,
        "gpipe": lambda p: p.get("pp_schedule") == "gpipe",
        "1f1b": lambda p: p.get("pp", 1) > 1 and p.get("pp_schedule", "1f1b") == "1f1b",
        "interleaved": lambda p: p.get("pp_schedule") == "interleaved_1f1b",
        "tp": lambda p: p.get("tp", 1) > 1 and p.get("pp", 1) == 1,
        "ac": lambda p: p.get("activation_checkpointing", False),
    }
    chosen = [next(n for n, p in layouts.items() if match(p)) for match in wanted.values()]
    return list(dict.fromkeys(chosen))


@pytest.mark.slow
@pytest.mark.parametrize("layout", covering(LAYOUTS))
def test_predicted_rank_memory_is_within_15_percent_of_the_measured_peak(layout, uninterrupted):
    raw = copy.deepcopy(BASE)
    raw["parallel"] = LAYOUTS[layout]
    spec = parse_spec(raw)
    measured = max(r["peak_mem_bytes"] for r in uninterrupted(raw))
    position = "only" if spec.parallel.pp == 1 else "first"  # rank 0
    predicted = memory_at(spec, Layout.of(spec.parallel), CPU, position).total
    assert predicted == pytest.approx(measured, rel=TOLERANCE), (
        f"{layout}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"
    )
