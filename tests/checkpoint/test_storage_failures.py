"""A save that cannot land (an unusable path, a full disk) fails alone: training goes on and
the previous checkpoint stays committed."""

from __future__ import annotations

import json

import pytest

from tests.checkpoint.jobs import JOB, committed_steps, root_args, spec
from tests.launch import run_trainer, step_records
from tests.tmpfs import small_tmpfs
from worker.ckpt_store import CheckpointStore

G0 = "g000000"  # a standalone run's generation directory


@pytest.mark.slow
def test_unusable_path_keeps_training_and_previous_checkpoint(tmp_path):
    s = spec(15, 5, mode="sync", dp=2)
    run_dir, root = tmp_path / "run", tmp_path / "root"
    (root / JOB / G0).mkdir(parents=True)
    (root / JOB / G0 / "step-00000010").write_text(
        "not a directory"
    )  # the save of step 10 cannot land
    out = run_trainer(s, run_dir, extra=root_args(root))
    records = step_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 16))
    assert "checkpoint at step 10 FAILED" in out.stderr
    assert committed_steps(root) == [5, 15]
    store = CheckpointStore(root, JOB)
    assert store.verify(store.pointer(5)).step == 5
    lines = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()]
    events = [x for x in lines if x.get("event") == "checkpoint_failed"]
    assert [e["step"] for e in events] == [10]
    # what each save held training for, failed or not (the goodput ledger's checkpoint time):
    # a sync save holds it for all of its writing
    saves = [x for x in lines if x.get("event") == "checkpoint"]
    assert [e["step"] for e in saves] == [5, 15] and all(e["blocking_s"] > 0 for e in saves)
    assert events[0]["blocking_s"] >= 0


@pytest.fixture
def tiny_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "6m") as mount:
        yield mount


@pytest.mark.slow
def test_disk_full_keeps_training_and_previous_checkpoint(tmp_path, tiny_disk):
    # one tiny checkpoint (dp2, 2 shards + optimizer) is ~4 MB: the second one cannot fit
    s = spec(12, 4, mode="async", dp=2)
    s["checkpoint"]["keep"] = 3
    out = run_trainer(s, tmp_path / "run", extra=root_args(tiny_disk))
    assert [r["step"] for r in step_records(tmp_path / "run")] == list(range(1, 13))
    assert "FAILED" in out.stderr
    committed = committed_steps(tiny_disk)
    assert committed and committed[0] == 4
    store = CheckpointStore(tiny_disk, JOB)
    for step in committed:
        store.verify(store.pointer(step))
