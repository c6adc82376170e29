"""Fencing chaos: a world cut off from Redis keeps training and saving, and forged checkpoints
sit on disk; neither may change what the job restores (docs/architecture.md, "Generation and
fencing").

Both end Succeeded with a loss curve bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.chaos.chaos import (
    assert_curve,
    at_step,
    disk_only,
    events,
    gone,
    kill,
    mesh_spec,
    metrics_path,
    rank,
    start,
    succeeded,
    wait_record,
)
from tests.chaos.faultproxy import FaultProxy
from tests.launch import train
from tests.stack import wait_until
from worker.ckpt_store import MANIFEST, CheckpointStore, Pointer

pytestmark = pytest.mark.slow


def committed_on_disk(gen_dir: Path) -> list[int]:
    return sorted(int(d.name[5:]) for d in gen_dir.glob("step-*") if (d / MANIFEST).is_file())


def test_partitioned_world_commits_and_deletes_nothing(stack, uninterrupted):
    """The agent of generation 1 loses Redis (a proxy stops moving its bytes) and its world
    trains on. The controller recovers onto the spare; when the link heals, generation 1 has
    moved no pointer and deleted no checkpoint, its trainer stops, and generation 2 restored
    exactly the checkpoint the pointer named at the cut.

    The world is one worker: with two, their last beats are up to a heartbeat apart, so the
    controller may see one silent a pass before the other and recover twice (generation 2
    then includes a worker that never hears of it), which is correct but not this test."""
    spec = disk_only(mesh_spec("fence-partition", steps=40, parallel={"dp": 1}))
    spec["checkpoint"]["keep"] = 20  # no legitimate pruning here: any deletion is the old world's
    want = uninterrupted(spec)
    cut_off = ["w0"]
    proxy = FaultProxy("127.0.0.1", stack.redis.port)
    try:
        for wid in cut_off:  # the same workers, now reaching Redis only through the proxy
            stack.agents[wid].stop()
            stack.restart_agent(wid, proxy.url)
        wait_until(
            lambda: set(cut_off) <= set(stack.idle_workers()), 90, f"{cut_off} idle via the proxy"
        )
        w, j1 = start(stack, spec)
        assert sorted(r.worker for r in j1.mesh.ranks) == cut_off, j1.mesh.ranks
        old_pids = [r.pid for r in j1.mesh.ranks]
        wait_record(metrics_path(stack, j1, 0), at_step(12), 120, "rank 0 at step 12")
        w.until(
            lambda j: j.last_checkpoint and j.last_checkpoint.step >= 10,
            60,
            "checkpoint 10 committed",
        )

        proxy.cut()
        time.sleep(0.5)  # a request the proxy forwarded just before the cut has landed by now
        at_cut = stack.store.checkpoint_history(j1.id)  # read directly: the pointer the cut froze
        cut_step = at_cut[0]["step"]
        gen1 = stack.checkpoint_dir(j1.id, spec) / "g000001"
        j2 = w.until(
            lambda j: j.generation == 2 and all(r.state == "running" for r in j.mesh.ranks),
            120,
            "generation 2 training on spares",
        )
        assert not {r.worker for r in j2.mesh.ranks} & set(cut_off), j2.mesh.ranks
        # The old world keeps training in the dark: wait until it saved past the cut, so the
        # heal below really delivers its held commit attempts.
        wait_until(
            lambda: [s for s in committed_on_disk(gen1) if s > cut_step],
            120,
            "generation 1 to save a checkpoint after the cut",
        )
        on_disk_before_heal = committed_on_disk(gen1)
        proxy.heal()
        wait_until(
            lambda: all(gone(p) for p in old_pids),
            60,
            "generation 1's trainers to stop after the heal",
        )
        j = w.finish()
    finally:
        proxy.close()
        for wid in cut_off:
            stack.agents[wid].stop()
            stack.restart_agent(wid)

    succeeded(stack, j)
    assert [(r.cause, r.action) for r in j.recoveries] == [("WorkerDead", "replace")], j.recoveries
    rec = j.recoveries[0]
    assert {f.worker for f in rec.faults} == set(cut_off), rec.faults
    # committed nothing: no generation-1 pointer past the cut, ever
    assert all(step <= cut_step for gen, step in w.pointers if gen == 1), w.pointers
    history = stack.store.checkpoint_history(j.id)
    assert all(h["step"] <= cut_step for h in history if h["generation"] == 1), history
    # deleted nothing: every checkpoint generation 1 wrote, before and after the cut, is there
    assert set(on_disk_before_heal) <= set(committed_on_disk(gen1))
    assert {h["step"] for h in at_cut} <= set(committed_on_disk(gen1))
    for h in history:  # and everything the pointer names still verifies
        CheckpointStore(
            stack.checkpoint_dir(j.id, spec).parent,
            spec["name"],
            generation=h["generation"],
            writer=j.id,
        ).verify(Pointer.from_json(h))
    assert rec.resumed_step == cut_step, (rec.resumed_step, cut_step)
    assert_curve(stack, j, want, exact=True)


def test_forged_and_foreign_checkpoints_are_never_restored(stack, uninterrupted, tmp_path):
    """Another job's checkpoint copied beside the committed one under a newer step name, and a
    forged newer generation's directory: rank 0 dies, and the job restores what the pointer
    names, not the newest directory on disk."""
    spec = disk_only(mesh_spec("fence-forged", parallel={"dp": 2}))
    spec["checkpoint"]["keep"] = 20  # generation 1's pointers stay in the history to compare with
    want = uninterrupted(spec)
    other = {
        **spec,
        "data": {"source": "synthetic", "seed": 99},
        "parallel": {"dp": 1},
        "train": {**spec["train"], "steps": 10},
    }
    train(
        other,
        tmp_path / "other",
        extra=["--checkpoint-root", str(tmp_path / "other-ck"), "--job-id", "other"],
    )
    foreign = tmp_path / "other-ck" / spec["name"] / "g000000" / "step-00000010"
    assert (foreign / MANIFEST).is_file()

    w, j1 = start(stack, spec)
    victim = rank(j1, 0)
    wait_record(metrics_path(stack, j1, 0), at_step(7), 120, "rank 0 at step 7")
    j = w.until(
        lambda j: j.last_checkpoint and j.last_checkpoint.step >= 5, 60, "checkpoint 5 committed"
    )
    ck = stack.checkpoint_dir(j1.id, spec)
    forged = [ck / "g000001" / "step-00000099", ck / "g000009" / "step-00000020"]
    for d in forged:
        shutil.copytree(foreign, d)
    kill(victim.pid)
    j = w.finish()

    succeeded(stack, j)
    assert [(r.cause, r.action) for r in j.recoveries] == [("TrainerKilled", "replace")], (
        j.recoveries
    )
    rec = j.recoveries[0]
    history = stack.store.checkpoint_history(j.id)
    assert rec.resumed_step == max(h["step"] for h in history if h["generation"] == 1), (
        rec,
        history,
    )
    assert "checkpoint_skipped" not in {e.reason for e in events(stack, j.id)}
    assert all((d / MANIFEST).is_file() for d in forged)  # never read, never touched
    assert_curve(stack, j, want, exact=True)
