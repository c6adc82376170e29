"""FSDP2's collectives on gloo without full-size copies (worker/trainer/gloo_comms.py): the
same bits as gloo's own calls, without the extra unsharded-size buffer each of those takes.
Three real gloo ranks (tests/numerics/gloo_comms_check.py)."""

import json

import pytest

from tests.launch import run_ranks


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    proc = run_ranks(3, "tests.numerics.gloo_comms_check", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_in_place_collective_gives_gloos_bits(ranks, collective):
    assert len(ranks) == 3
    assert all(r[collective]["equal"] for r in ranks), ranks


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_in_place_collective_takes_no_unsharded_size_copy(ranks, collective):
    """gloo's own call raises the peak by at least one more unsharded-size buffer (its clone or
    flat output); the in-place one by well under a quarter of one."""
    for r in ranks:
        c = r[collective]
        assert c["grew_default"] > 0.9, (collective, c)
        assert c["grew_in_place"] < 0.25, (collective, c)


def test_fsdp_gradients_are_bitwise_the_defaults(ranks):
    assert all(r["fsdp"]["equal"] and r["fsdp"]["tensors"] == 4 for r in ranks), ranks
