"""Checkpoint storage is checked at start (worker/trainer/storage_check.py): a job whose two
hosts each checkpoint to a disk of their own fails before its first step, naming the fix,
instead of training and then failing every commit."""

from __future__ import annotations

import pytest

from tests.stack import Stack, tiny_spec, wait_phase

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_disks(tmp_path_factory):
    """Two agents, each a host of its own (network and memory), each with its own
    --checkpoint-root."""
    s = Stack(
        tmp_path_factory.mktemp("local-disks"),
        workers=2,
        hosts=True,
        netns=True,
        shared_checkpoints=False,
    )
    yield s
    s.close()


def test_a_job_over_node_local_checkpoint_roots_fails_at_start_naming_the_fix(local_disks):
    jid = local_disks.client.submit(tiny_spec("local-disks", train={"steps": 50})).id
    j = wait_phase(local_disks.client, jid, ("Failed", "Succeeded"), 180)
    failed = j.condition("Failed")
    assert j.phase == "Failed" and failed.reason == "TrainerFailed", j.conditions
    assert "checkpoint storage is not shared" in failed.message, failed.message
    assert "rank 1 on" in failed.message and "--checkpoint-root on shared" in failed.message
    # before any step: the first rank out exits 2, its peer may be stopped by then
    assert j.step == 0 and 2 in {r.exit_code for r in j.mesh.ranks}, j.mesh.ranks
