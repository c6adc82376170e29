"""A job on a prepared dataset (real text, several epochs) under the controller: a rank
SIGKILLed mid-epoch and restored from memory, and a rank SIGKILLed after an epoch boundary and
restored from a disk checkpoint before it. Both end with the uninterrupted run's training and
validation losses, bit for bit, and the same epoch on every step."""

from __future__ import annotations

import pytest

from dataset.format import read_manifest
from tests.chaos.chaos import disk_only, mesh_spec, survives_one_kill
from tests.corpus import prepared, stdlib_docstrings

pytestmark = pytest.mark.slow

SEQ, BATCH = 64, 16


@pytest.fixture(scope="module")
def corpus(shared_stack):
    out, _ = prepared(
        stdlib_docstrings(14_000), shared_stack.data / "chaos-corpus", val_fraction=0.4
    )
    return out


def dataset_spec(name: str, corpus) -> dict:
    spec = mesh_spec(name, train={"global_batch": BATCH})
    spec["model"] = {"preset": "tiny", "seq_len": SEQ, "vocab": 512}
    spec["data"] = {"source": f"dataset:{corpus}", "seed": 3}
    spec["eval"] = {"every_steps": 3, "batches": 1}
    return spec


def epoch_steps(corpus) -> float:
    return (read_manifest(corpus).splits["train"].tokens - 1) // SEQ / BATCH


def recovered_exactly(stack, spec: dict, kill_at: int, want: list[dict], committed: int = 0):
    """One recovery from a kill at `kill_at`; the eval losses and epochs exact too."""
    j, curve = survives_one_kill(stack, spec, kill_at, want, committed)
    for r in want:
        got = curve[r["step"]]
        assert (got.get("eval_loss"), got["epoch"]) == (r.get("eval_loss"), r["epoch"]), r["step"]
    return j.recoveries[0]


def test_a_kill_mid_epoch_restores_from_memory_to_the_exact_losses(stack, corpus, uninterrupted):
    spec = dataset_spec("chaos-epoch-mid", corpus)
    want = uninterrupted(spec)
    assert 4 < epoch_steps(corpus) < 7 and want[-1]["epoch"] >= 2  # several epochs in 15 steps
    kill_at = 9
    assert want[kill_at - 2]["epoch"] == want[kill_at]["epoch"]  # the redo stays in one epoch
    rec = recovered_exactly(stack, spec, kill_at, want)
    assert set(rec.restored_from.values()) <= {"memory", "peer"}


def test_a_kill_past_an_epoch_boundary_redoes_it_from_disk_exactly(stack, corpus, uninterrupted):
    spec = disk_only(dataset_spec("chaos-epoch-edge", corpus))
    want = uninterrupted(spec)
    kill_at = 9  # after the checkpoint of step 5; steps 6..9 cross into the next epoch
    assert want[5]["epoch"] < want[kill_at - 1]["epoch"]
    rec = recovered_exactly(stack, spec, kill_at, want, committed=5)
    assert rec.resumed_step == 5 and set(rec.restored_from.values()) == {"disk"}
