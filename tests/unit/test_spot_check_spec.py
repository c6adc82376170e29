"""A `compute` bit flip (services/spec.py) fires inside a re-execution spot check, so the spec
refuses one that no spot check would ever reach, naming the field and the fix; and which
layouts run spot checks at all."""

from __future__ import annotations

import pytest

from services.spec import SpecError, parse_spec, spot_checked

GOOD = {
    "name": "spot",
    "model": {"preset": "tiny"},
    "parallel": {"dp": 2, "zero": 3},
    "train": {"steps": 20, "global_batch": 8},
    "sdc": {"spot_every_steps": 5},
}


def compute(step: int = 10, **spec) -> dict:
    return {**GOOD, "chaos": {"bitflip": [{"rank": 1, "step": step, "tensor": "compute"}]}, **spec}


def problems(spec: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    return {p.field: p.message for p in info.value.problems}


def test_a_compute_flip_at_a_check_step_of_a_spot_checked_layout_is_accepted():
    (flip,) = parse_spec(compute()).chaos.bitflip
    assert (flip.tensor, flip.step, flip.bit) == ("compute", 10, 30)


@pytest.mark.parametrize(
    "parallel, fix",
    [
        ({"dp": 2, "zero": 0}, "compares DP replicas instead (dp 2, zero 0): flip param"),
        ({"dp": 2, "zero": 3, "pp": 2, "microbatches": 2}, "pipeline layouts (pp 2) run none"),
    ],
    ids=["replicas", "pipeline"],
)
def test_a_compute_flip_where_no_spot_check_runs_names_the_tensor_and_the_fix(parallel, fix):
    got = problems(compute(parallel=parallel))
    assert list(got) == ["chaos.bitflip[0].tensor"], got
    assert fix in got["chaos.bitflip[0].tensor"], got


def test_a_compute_flip_with_sdc_off_says_to_turn_it_on():
    got = problems(compute(sdc={"enabled": False}))
    assert "set sdc.enabled: true" in got["chaos.bitflip[0].tensor"], got


@pytest.mark.parametrize("step", [7, 20], ids=["between-checks", "last-step"])
def test_a_compute_flip_off_a_check_step_names_the_steps_it_could_use(step):
    got = problems(compute(step=step))
    assert list(got) == ["chaos.bitflip[0].step"], got
    why = got["chaos.bitflip[0].step"]
    assert "multiples of sdc.spot_every_steps (5) below train.steps (20)" in why, why
    assert "choose one of [5, 10, 15]" in got["chaos.bitflip[0].step"], got


def test_a_compute_flip_past_the_last_step_is_told_once():
    got = problems(compute(step=25))
    assert "train.steps is 20" in got["chaos.bitflip[0].step"], got


@pytest.mark.parametrize(
    "parallel, sdc, want",
    [
        ({"dp": 2, "zero": 0}, True, False),  # replicas: fingerprints instead
        ({"dp": 2, "zero": 2}, True, True),
        ({"dp": 1, "tp": 2}, True, True),
        ({"dp": 2, "zero": 3, "pp": 2, "microbatches": 2}, True, False),
        ({"dp": 2, "zero": 3}, False, False),
    ],
)
def test_which_layouts_run_spot_checks(parallel, sdc, want):
    spec = parse_spec({**GOOD, "parallel": parallel, "sdc": {"enabled": sdc}})
    assert spot_checked(spec) is want
