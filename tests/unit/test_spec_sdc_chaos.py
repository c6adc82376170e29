"""The `sdc` and `chaos` sections of the job spec (services/spec.py): defaults, bounds, and
bit flips that must land on a rank and a step the job has, each refusal naming its field
(`chaos.bitflip[i].rank`) and the fix."""

from __future__ import annotations

import pytest

from services.spec import SpecError, parse_spec

GOOD = {
    "name": "flips",
    "model": {"preset": "tiny"},
    "parallel": {"dp": 2, "tp": 2, "zero": 0},
    "train": {"steps": 20, "global_batch": 8},
}


def flips(*bitflip: dict, **spec) -> dict:
    return {**GOOD, "chaos": {"bitflip": list(bitflip)}, **spec}


def problems(spec: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    return {p.field: p.message for p in info.value.problems}


def test_checks_default_to_every_ten_steps_and_chaos_to_none():
    s = parse_spec(GOOD)
    assert (s.sdc.enabled, s.sdc.every_steps, s.sdc.anomaly_window, s.sdc.anomaly_z) == (
        True,
        10,
        50,
        8.0,
    )
    assert s.chaos is None


def test_a_bit_flip_defaults_to_the_top_exponent_bit():
    s = parse_spec(flips({"rank": 3, "step": 20, "tensor": "optim"}))
    (flip,) = s.chaos.bitflip
    assert (flip.rank, flip.step, flip.tensor, flip.bit) == (3, 20, "optim", 30)


def test_a_rank_beyond_the_world_is_named_with_the_fix():
    got = problems(
        flips({"rank": 0, "step": 1, "tensor": "param"}, {"rank": 4, "step": 1, "tensor": "grad"})
    )
    assert list(got) == ["chaos.bitflip[1].rank"]
    assert "dp*pp*tp = 2*1*2 = 4 ranks; choose a rank below 4" in got["chaos.bitflip[1].rank"]


def test_a_step_beyond_train_steps_is_named_with_the_fix():
    got = problems(flips({"rank": 0, "step": 21, "tensor": "param"}))
    assert list(got) == ["chaos.bitflip[0].step"]
    assert "train.steps is 20; choose a step from 1 to 20" in got["chaos.bitflip[0].step"]


@pytest.mark.parametrize(
    "flip,field,fix",
    [
        (
            {"rank": 0, "step": 1, "tensor": "weights"},
            "chaos.bitflip[0].tensor",
            "'param', 'grad', 'optim', 'compute' or 'idle'",
        ),
        (
            {"rank": 0, "step": 0, "tensor": "grad"},
            "chaos.bitflip[0].step",
            "greater than or equal to 1",
        ),
        (
            {"rank": -1, "step": 1, "tensor": "grad"},
            "chaos.bitflip[0].rank",
            "greater than or equal to 0",
        ),
        (
            {"rank": 0, "step": 1, "tensor": "grad", "bit": 32},
            "chaos.bitflip[0].bit",
            "less than or equal to 31",
        ),
        ({"rank": 0, "step": 1}, "chaos.bitflip[0].tensor", "required; add it"),
        (
            {"rank": 0, "step": 1, "tensor": "grad", "byte": 1},
            "chaos.bitflip[0].byte",
            "valid: bit, rank, step, tensor",
        ),
    ],
)
def test_a_malformed_bit_flip_names_its_field(flip, field, fix):
    got = problems(flips(flip))
    assert field in got, got
    assert fix in got[field], got[field]


def test_at_most_64_bit_flips():
    flip = {"rank": 0, "step": 1, "tensor": "grad"}
    parse_spec(flips(*[flip] * 64))
    assert "at most 64" in problems(flips(*[flip] * 65))["chaos.bitflip"]


def test_a_memory_limit_names_a_rank_the_job_has():
    s = parse_spec({**GOOD, "chaos": {"memory_limit": [{"rank": 3, "mib": 64}]}})
    assert [(m.rank, m.mib) for m in s.chaos.memory_limit] == [(3, 64)]
    got = problems({**GOOD, "chaos": {"memory_limit": [{"rank": 4, "mib": 64}]}})
    assert "choose a rank below 4" in got["chaos.memory_limit[0].rank"], got
    got = problems({**GOOD, "chaos": {"memory_limit": [{"rank": 0, "mib": 0}]}})
    assert "chaos.memory_limit[0].mib" in got, got


@pytest.mark.parametrize("name", ["device_oom", "device_error"])
def test_a_device_fault_names_a_rank_and_a_step_the_job_has(name):
    s = parse_spec({**GOOD, "chaos": {name: [{"rank": 3, "step": 20}]}})
    assert [(f.rank, f.step) for f in getattr(s.chaos, name)] == [(3, 20)]
    got = problems({**GOOD, "chaos": {name: [{"rank": 4, "step": 21}]}})
    assert "choose a rank below 4" in got[f"chaos.{name}[0].rank"], got
    assert "choose a step from 1 to 20" in got[f"chaos.{name}[0].step"], got


def test_bit_flips_need_a_fixed_layout():
    spec = flips({"rank": 0, "step": 1, "tensor": "grad"}, parallel={"auto": True})
    assert "remove parallel.auto" in problems(spec)["chaos.bitflip"]


@pytest.mark.parametrize(
    "sdc,field,fix",
    [
        ({"every_steps": 0}, "sdc.every_steps", "greater than 0"),
        ({"anomaly_window": 7}, "sdc.anomaly_window", "greater than or equal to 8"),
        ({"anomaly_z": 0}, "sdc.anomaly_z", "greater than 0"),
        ({"enabled": "yes"}, "sdc.enabled", "true or false"),
        (
            {"every": 5},
            "sdc.every",
            "valid: anomaly_window, anomaly_z, at_rest, enabled, every_steps",
        ),
    ],
)
def test_bad_sdc_settings_name_their_field(sdc, field, fix):
    got = problems({**GOOD, "sdc": sdc})
    assert field in got, got
    assert fix in got[field], got[field]


def test_a_mistyped_key_is_never_pointed_at_the_chaos_hook():
    assert "chaos" not in problems({**GOOD, "snapshots": {}})["snapshots"]


@pytest.mark.parametrize("bad", [0, -0.5, 61])
def test_a_step_floor_out_of_range_is_named(bad):
    got = problems({**GOOD, "chaos": {"min_step_s": bad}})
    assert list(got) == ["chaos.min_step_s"], got


def test_a_step_floor_alone_is_a_valid_chaos_section():
    s = parse_spec({**GOOD, "chaos": {"min_step_s": 0.2}})
    assert (s.chaos.min_step_s, s.chaos.bitflip, s.chaos.memory_limit) == (0.2, [], [])
