"""Sharded checkpoints with real processes: exact resume, resharding, crashes, bad storage."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.procs import free_port
from tests.launch import (
    ENV,
    ROOT,
    kill_all,
    read_records,
    run_trainer,
    start_trainer,
    step_records,
    train,
    trainer_command,
    wait_for,
)
from worker.ckpt_store import (
    MANIFEST,
    CheckpointStore,
    DamagedCheckpoint,
    Pointer,
    remove_checkpoints,
    write_digests,
)
from worker.trainer.train_state import DataStream, ResumeRefused

JOB = "ckpt"
G0 = "g000000"  # a standalone run's generation directory


def spec(steps: int, every: int, mode: str = "async", **parallel) -> dict:
    return {
        "name": JOB,
        "model": {"preset": "tiny"},
        "data": {"seed": 11},
        "parallel": parallel,
        "train": {"steps": steps, "global_batch": 8, "lr": 1e-3, "warmup_steps": 3},
        "checkpoint": {"every_steps": every, "keep": 5, "mode": mode},
    }


def root_args(root: Path) -> list[str]:
    return ["--checkpoint-root", str(root)]


def committed_steps(root: Path) -> list[int]:
    """Steps the standalone pointer (committed.json) names."""
    return sorted(p.step for p in CheckpointStore(root, JOB).history())


def losses(records: list[dict], first: int, last: int) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if first <= r["step"] <= last}


def since_last_restore(run_dir: Path) -> list[dict]:
    """The step records written after the last restore (a resumed run appends to the file)."""
    records = read_records(run_dir)
    last = max(i for i, r in enumerate(records) if r.get("event") == "restored")
    return [r for r in records[last:] if "step" in r and "event" not in r]


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    s = spec(30, 10, dp=2, tp=2)
    full = train(s, tmp_path / "full", extra=root_args(tmp_path / "full-ckpt"))
    assert committed_steps(tmp_path / "full-ckpt") == [10, 20, 30]

    run_dir, root = tmp_path / "killed", tmp_path / "killed-ckpt"
    proc = start_trainer(s, run_dir, root_args(root))
    wait_for(
        "step 17 with checkpoint 10 committed",
        lambda: any(r["step"] >= 17 for r in step_records(run_dir)) and 10 in committed_steps(root),
        proc,
    )
    kill_all(proc)
    assert max(r["step"] for r in step_records(run_dir)) <= 20
    again = run_trainer(s, run_dir, extra=root_args(root), fresh=False)
    assert "resumed from step 10" in again.stdout and "same mesh" in again.stdout
    resumed = since_last_restore(run_dir)
    assert [r["step"] for r in resumed] == list(range(11, 31))
    # steps 11-30, from the restarted run, equal the uninterrupted run's bit for bit
    assert losses(resumed, 11, 30) == losses(full, 11, 30)
    assert len(losses(full, 11, 30)) == 20


RESHARD = [  # (saved on, resumed on): covers dp 2->1, 1->2, 4->2, tp 2->1, pp 2->1
    ({"dp": 2, "tp": 2}, {"dp": 1}),
    ({"dp": 4}, {"dp": 2, "pp": 2, "microbatches": 2}),
    ({"pp": 2, "microbatches": 2}, {"dp": 2, "zero": 2}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "saved,resumed", RESHARD, ids=["dp2tp2-to-dp1", "dp4-to-dp2pp2", "pp2-to-dp2"]
)
def test_resume_on_another_mesh(tmp_path, saved, resumed):
    full = train(spec(20, 10, **saved), tmp_path / "full", extra=root_args(tmp_path / "root"))
    shutil.rmtree(tmp_path / "root" / JOB / G0 / "step-00000020")
    out = run_trainer(
        spec(20, 10, **resumed), tmp_path / "resumed", extra=root_args(tmp_path / "root")
    )
    assert "resumed from step 10" in out.stdout and "resharded" in out.stdout
    got, want = losses(step_records(tmp_path / "resumed"), 11, 20), losses(full, 11, 20)
    assert got.keys() == want.keys() and len(got) == 10
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"


def run_ranks(s: dict, run_dir: Path, root: Path) -> list[subprocess.CompletedProcess]:
    """Every rank as its own `python -m worker.trainer` process, as an agent starts them (no
    torchrun, whose own traceback on a failed rank would hide the trainer's): each rank's
    exit code and output."""
    p = s.get("parallel", {})
    world = p.get("dp", 1) * p.get("pp", 1) * p.get("tp", 1)
    cmd = trainer_command(s, run_dir, root_args(root))
    cmd = [sys.executable, *cmd[cmd.index("-m", 3) :]]  # the trainer's own argv, after torchrun's
    rdzv = {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**ENV, **rdzv, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


REFUSED = {  # a changed spec field -> the message the resume must stop with
    "data.seed": "checkpoint step 10 was trained with data.seed=11; this spec has data.seed=12: "
    "resume with the original seed or start a new job",
    "train.global_batch": "checkpoint step 10 consumed 80 samples (train.global_batch=8); this "
    "spec has train.global_batch=16, which makes 160: resume with the "
    "original global batch or start a new job",
}


@pytest.mark.slow
@pytest.mark.parametrize("field", list(REFUSED))
def test_resume_on_other_data_is_refused(tmp_path, field):
    """A checkpoint resumed with another data seed or global batch would train on samples it
    never saw while claiming its step: the trainer exits 2 (a deterministic failure for the
    controller) with one line naming the field and the fix, and trains nothing."""
    root = tmp_path / "root"
    train(spec(10, 5, mode="sync"), tmp_path / "saved", extra=root_args(root))
    changed = spec(20, 5, mode="sync", dp=2)  # another dp alone would resume (resharded)
    section, key = field.split(".")
    changed[section][key] = {"data.seed": 12, "train.global_batch": 16}[field]
    for rank in run_ranks(changed, tmp_path / "resumed", root):
        assert (rank.returncode, rank.stderr) == (
            2,
            f"meshkeeper: cannot resume: {REFUSED[field]}\n",
        )
    assert step_records(tmp_path / "resumed") == []
    assert committed_steps(root) == [5, 10]  # nothing was overwritten


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


@pytest.mark.slow
def test_sigkill_during_async_save_leaves_no_committed_partial(tmp_path):
    s = spec(40, 3, dp=2)
    run_dir, root = tmp_path / "run", tmp_path / "root"
    proc = start_trainer(s, run_dir, root_args(root))

    def shards_without_manifest() -> bool:
        return any(
            any(d.glob("*.distcp")) and not (d / MANIFEST).exists() and committed_steps(root)
            for d in (root / JOB / G0).glob("step-*")
        )

    wait_for("a save in flight after a committed one", shards_without_manifest, proc)
    kill_all(proc)
    partial = [d for d in (root / JOB / G0).glob("step-*") if not (d / MANIFEST).exists()]
    assert partial, "the kill did not land inside a save"
    newest_committed = committed_steps(root)[-1]
    assert all(int(d.name[5:]) > newest_committed for d in partial)
    again = run_trainer(s, run_dir, extra=root_args(root), fresh=False)
    # the partial save is newer but no pointer names it: it is never even looked at
    assert f"resumed from step {newest_committed}" in again.stdout
    assert "WARNING" not in again.stderr


@pytest.mark.slow
def test_corrupt_shard_falls_back_to_previous(tmp_path):
    s = spec(20, 10, dp=2)
    run_dir, root = tmp_path / "run", tmp_path / "root"
    train(s, run_dir, extra=root_args(root) + ["--generation", "3"])
    shard = sorted((root / JOB / "g000003" / "step-00000020").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    manifest = json.loads((root / JOB / "g000003" / "step-00000010" / MANIFEST).read_text())
    assert manifest["generation"] == 3 and manifest["mesh"] == {"dp": 2, "pp": 1, "tp": 1}
    again = run_trainer(s, run_dir, extra=root_args(root) + ["--generation", "4"])
    assert "g000003/step-00000020: checksum mismatch" in again.stderr
    assert "resumed from step 10" in again.stdout
    assert [r["step"] for r in step_records(run_dir)] == list(range(11, 21))


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
    events = [
        json.loads(x)
        for x in (run_dir / "steps.jsonl").read_text().splitlines()
        if "checkpoint_failed" in x
    ]
    assert [e["step"] for e in events] == [10]


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"this test needs root to mount a small tmpfs: {proc.stderr}"
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


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
