"""ZeRO levels under a pipeline (worker/trainer/pipeline.py): zero 3 keeps each stage sharded
across microbatches, reducing every microbatch's gradients as its backward ends; zero 2 keeps
torch's accumulation, gradients reduced once after the last microbatch."""

import json

import pytest

from tests.launch import run_ranks


def after_backward(zero: int) -> list[list[dict]]:
    proc = run_ranks(4, "tests.numerics.pipeline_zero_check", [str(zero)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert len(ranks) == 4 and {r["pp"] for r in ranks} == {0, 1}
    return [r["after_backward"] for r in ranks]


@pytest.mark.slow
def test_zero3_reshards_and_reduces_after_every_microbatch():
    for seen in after_backward(3):
        assert len(seen) == 2, seen  # one record per microbatch backward
        assert all(s["sharded"] and s["grads"] for s in seen), seen


@pytest.mark.slow
def test_zero2_accumulates_unsharded_until_the_step_ends():
    for seen in after_backward(2):
        assert len(seen) == 2, seen
        assert not any(s["sharded"] or s["grads"] for s in seen), seen
