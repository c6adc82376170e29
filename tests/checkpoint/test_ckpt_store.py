"""The checkpoint layout without processes: pointer history, pruning, forged and foreign
directories, digests gathered into the manifest, the restore split, the data-stream check."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from worker.ckpt_store import (
    CheckpointStore,
    DamagedCheckpoint,
    Pointer,
    remove_checkpoints,
    share,
    write_digests,
)
from worker.trainer.train_state import DataStream, ResumeRefused

JOB = "ckpt"


def test_data_stream_check_names_the_field():
    same = DataStream(seed=7, global_batch=8)
    same.check_resume(same.train_state(40))  # the state it saved itself resumes
    DataStream(seed=7, global_batch=8).check_resume(
        {"step": 40, "consumed_samples": 320, "data_seed": 7}
    )
    with pytest.raises(
        ResumeRefused,
        match=r"data.seed=7; this spec has data.seed=8: resume "
        r"with the original seed",
    ):
        DataStream(seed=8, global_batch=8).check_resume(same.train_state(40))
    with pytest.raises(
        ResumeRefused,
        match=r"consumed 320 samples \(train.global_batch=8\); "
        r"this spec has train.global_batch=4, which makes 160",
    ):
        DataStream(seed=7, global_batch=4).check_resume(same.train_state(40))


def test_data_stream_check_names_another_dataset():
    saved = DataStream(seed=7, global_batch=8, source="c541ee4ff45cd457").train_state(40)
    DataStream(seed=7, global_batch=8, source="c541ee4ff45cd457").check_resume(saved)
    with pytest.raises(ResumeRefused, match="trained on another dataset .content id c541ee4f"):
        DataStream(seed=7, global_batch=8, source="c9703065d91fc952").check_resume(saved)
    # a checkpoint from before datasets were recorded resumes as before
    DataStream(seed=7, global_batch=8, source="c9703065d91fc952").check_resume(
        DataStream(seed=7, global_batch=8).train_state(40)
    )


def fake_checkpoint(store: CheckpointStore, step: int) -> Pointer:
    d = store.step_dir(step)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    write_digests(d, 0, [])  # rank 0 wrote only .metadata, which the commit hashes itself
    store.commit(step, {}, ranks=1)
    return store.pointer(step)


def test_standalone_pointer_prunes_only_what_fell_out_of_it(tmp_path):
    store = CheckpointStore(tmp_path, JOB)
    for step in (1, 2, 3, 4):
        fake_checkpoint(store, step)
        remove_checkpoints(store.dir, store.record(step, keep=2))
    store.step_dir(5).mkdir()  # a save in flight: no pointer names it, nothing may delete it
    assert sorted(d.name for d in store.gen_dir.iterdir()) == [
        "step-00000003",
        "step-00000004",
        "step-00000005",
    ]
    assert [p.step for p in store.history()] == [4, 3]
    assert store.verify(store.pointer(4)).manifest["step"] == 4


def test_restore_ignores_forged_and_foreign_checkpoints(tmp_path):
    """A newer step-* directory that no pointer names is never read, and a checkpoint of
    another job (or generation) copied to where the pointer points fails verification."""
    ours = CheckpointStore(tmp_path, JOB, generation=2, writer="job-a")
    good = fake_checkpoint(ours, 10)
    forged = CheckpointStore(tmp_path, JOB, generation=9, writer="job-a")
    fake_checkpoint(forged, 99)  # a stale or forged newer directory
    assert ours.first_valid([good], warn=print).step == 10

    theirs = CheckpointStore(tmp_path / "other", JOB, generation=2, writer="job-b")
    foreign = fake_checkpoint(theirs, 20)
    copy = ours.step_dir(20)
    shutil.copytree(foreign.path, copy)
    skipped: list[str] = []
    assert ours.first_valid([ours.pointer(20), good], warn=skipped.append).step == 10
    assert skipped == [
        "g000002/step-00000020: manifest says job 'job-b' generation 2 step 20, "
        "the pointer says job 'job-a' generation 2 step 20"
    ]
    with pytest.raises(DamagedCheckpoint, match="generation 9"):
        ours.verify(Pointer(99, 2, str(forged.step_dir(99))))


def test_removal_never_leaves_the_job_directory(tmp_path):
    store = CheckpointStore(tmp_path / "ck", JOB)
    outside = tmp_path / "precious"
    outside.mkdir()
    remove_checkpoints(
        store.dir, [Pointer(1, 0, str(outside)), Pointer(1, 0, str(store.dir / ".." / "step-1"))]
    )
    assert outside.is_dir()


def test_commit_gathers_digests_a_rank_writes_later(tmp_path):
    """Rank 0's commit waits for a rank still hashing, reading its digests from the disk."""
    store = CheckpointStore(tmp_path, JOB)
    d = store.step_dir(1)
    d.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (d / name).write_bytes(name.encode())
    write_digests(d, 0, ["__0_0.distcp"])
    late = threading.Timer(0.3, write_digests, (d, 1, ["__1_0.distcp"]))
    late.start()
    t0 = time.monotonic()
    store.commit(1, {}, ranks=2)
    assert time.monotonic() - t0 >= 0.3
    files = store.verify(store.pointer(1)).manifest["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_commit_refuses_a_file_no_rank_hashed(tmp_path):
    store = CheckpointStore(tmp_path, JOB)
    d = store.step_dir(1)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    (d / "__1_0.distcp").write_bytes(b"stray")
    write_digests(d, 0, [])
    with pytest.raises(DamagedCheckpoint, match="no rank hashed __1_0.distcp"):
        store.commit(1, {}, ranks=1)
    assert not (d / "manifest.json").exists()


def test_commit_fails_at_once_when_a_rank_cannot_hash(tmp_path):
    store = CheckpointStore(tmp_path, JOB)
    d = store.step_dir(1)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    write_digests(d, 0, ["__0_0.distcp"])  # a file that is not there
    with pytest.raises(DamagedCheckpoint, match="rank 0 could not hash its files"):
        store.commit(1, {}, ranks=1)


def test_restore_share_splits_files_by_size_over_ranks():
    files = {n: {"bytes": b} for n, b in [("a", 10), ("b", 9), ("c", 2), ("d", 1), ("e", 1)]}
    parts = [share(files, r, 2) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(files)  # every file, each once
    assert parts == [["a", "d", "e"], ["b", "c"]]  # 12 and 11 bytes: balanced by size
