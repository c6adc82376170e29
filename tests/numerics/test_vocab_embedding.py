"""The vocab-parallel embedding (worker/trainer/vocab_embedding.py): torch's numbers, with a
gradient of this rank's vocabulary slice only. Two real gloo ranks
(tests/numerics/vocab_embedding_check.py)."""

import json

import pytest

from tests.launch import run_ranks


@pytest.fixture(scope="module")
def results() -> list[dict]:
    proc = run_ranks(2, "tests.numerics.vocab_embedding_check", timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_output_and_gradient_are_rowwise_parallels_bits(results):
    assert len(results) == 4  # two layouts on two ranks
    assert all(r["same_output"] and r["same_grad"] for r in results), results


def test_gradient_holds_only_this_ranks_rows(results):
    """torch's RowwiseParallel hands back the whole vocabulary's gradient on every rank."""
    for r in results:
        assert r["torch_grad_placements"] == "(Replicate(),)", r
        assert r["grad_placements"] == "(Shard(dim=0),)", r
        assert r["grad_rows"] == r["weight_rows"] < 1001, r
    assert sorted(r["weight_rows"] for r in results if r["layout"] == "R") == [500, 501]
