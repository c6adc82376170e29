"""Jobs through the whole control plane: REST -> controller -> Redis -> agents -> real trainers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import (
    WORKERS,
    process_groups_alive,
    tiny_spec,
    wait_phase,
    wait_until,
)


def rank0_losses(stack, job) -> list[float]:
    rank0 = next(r for r in job.mesh.ranks if r.rank == 0)
    path = stack.job_dir(rank0.worker, job.id, job.generation) / "metrics-0.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows if "step" in r and "event" not in r]


def assert_cancelled_only(job) -> None:
    """Cancelled is the job's one outcome: no `Failed` (nor anything else) beside it."""
    true = {c.type: c.reason for c in job.conditions if c.status == "True"}
    assert true == {"Admitted": true.get("Admitted"), "Cancelled": "Cancelled"}, job.conditions


def assert_succeeded(stack, job_id: str, spec: dict) -> None:
    p = spec["parallel"]
    world = p.get("dp", 1) * p.get("pp", 1) * p.get("tp", 1)
    j = stack.client.job(job_id)
    assert j.phase == "Succeeded", stack.logs()
    assert j.condition("Succeeded").status == "True"
    assert j.condition("Succeeded").reason == "AllRanksSucceeded"
    assert j.condition("Admitted").status == "True"
    assert j.condition("Running").status == "False"
    assert (j.generation, j.restarts) == (1, 0)
    assert j.step == j.steps == spec["train"]["steps"]
    assert j.finished_at >= j.started_at >= j.submitted_at
    assert j.mesh.shape.model_dump() == {
        "dp": p.get("dp", 1),
        "pp": p.get("pp", 1),
        "tp": p.get("tp", 1),
    }
    ranks = sorted(j.mesh.ranks, key=lambda r: r.rank)
    assert [r.rank for r in ranks] == list(range(world))
    assert all(r.state == "succeeded" and r.exit_code == 0 for r in ranks), ranks
    assert len({r.worker for r in ranks}) == world  # one rank per 1-device worker
    for r in ranks:  # TP innermost, DP outermost: the trainer's init_device_mesh order
        c = r.coord
        assert r.rank == (c.dp * p.get("pp", 1) + c.pp) * p.get("tp", 1) + c.tp
    # the final save committed, and rank 0's agent moved the pointer (generation-guarded CAS)
    ck = j.last_checkpoint
    assert ck is not None and (ck.step, ck.generation) == (spec["train"]["steps"], 1), ck
    assert ck.path.startswith(str(stack.work / "checkpoints" / job_id))
    assert (Path(ck.path) / "manifest.json").exists()
    losses = rank0_losses(stack, j)
    assert len(losses) == spec["train"]["steps"]
    assert j.loss == pytest.approx(losses[-1])
    assert losses[-1] < 0.9 * losses[0], f"loss did not fall: {losses}"
    reasons = [e.reason for e in stack.client.events(job_id)]
    for r in ("Submitted", "Placed", "TrainerStarted", "TrainerExited", "AllRanksSucceeded"):
        assert r in reasons, reasons


@pytest.mark.slow
def test_1d_job_succeeds_end_to_end(stack):
    spec = tiny_spec("e2e-1d", train={"steps": 12})
    jid = stack.client.submit(spec).id
    assert stack.client.job(jid).phase in ("Pending", "Running")
    wait_phase(stack.client, jid, ("Succeeded", "Failed", "Cancelled"), 120)
    assert_succeeded(stack, jid, spec)
    wait_until(lambda: len(stack.idle_workers()) == WORKERS, 20, "workers back to idle")


@pytest.mark.slow
def test_3d_job_succeeds_end_to_end(stack):
    spec = tiny_spec(
        "e2e-3d", parallel={"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}, train={"steps": 8}
    )
    jid = stack.client.submit(spec).id
    wait_phase(stack.client, jid, ("Succeeded", "Failed", "Cancelled"), 240)
    assert_succeeded(stack, jid, spec)
    j = stack.client.job(jid)
    # every rank reports the rank's own compute and its time waiting in collectives
    assert all(r.compute_s is not None and r.wait_s is not None for r in j.mesh.ranks)


@pytest.mark.slow
def test_second_job_waits_for_capacity_then_runs(stack):
    # each job takes 2 ranks + 3 spares = 5 of the 8 workers: only one fits at a time
    spec = tiny_spec("cap", fault_tolerance={"spares": 3}, train={"steps": 10})
    first = stack.client.submit(spec).id
    second = stack.client.submit(spec).id
    j1 = wait_phase(stack.client, first, ("Running",), 60)
    assert len(j1.mesh.spares) == 3
    roles = {w.id: w.role for w in stack.client.workers() if w.job == first}
    assert sorted(roles.values()) == ["rank", "rank", "spare", "spare", "spare"]
    j2 = wait_until(
        lambda: (
            (j := stack.client.job(second)).condition("Running").reason == "WaitingForCapacity"
            and j
        ),
        10,
        "the second job to wait",
    )
    assert j2.phase == "Pending"
    waiting = j2.condition("Running")
    assert (waiting.status, waiting.reason) == ("False", "WaitingForCapacity")
    assert "needs 2 worker slots + 3 spare workers" in waiting.message
    wait_phase(stack.client, first, ("Succeeded",), 120)
    done = wait_phase(stack.client, second, ("Succeeded", "Failed", "Cancelled"), 120)
    assert done.phase == "Succeeded"
    assert done.started_at >= stack.client.job(first).finished_at  # strictly after the first
    assert "WaitingForCapacity" in [e.reason for e in stack.client.events(second)]


@pytest.mark.slow
def test_a_smaller_job_backfills_past_one_that_does_not_fit_yet(stack):
    """A job that fits starts while an earlier one waits for workers (docs/control-plane.md,
    "Scheduling": backfill); the earlier one still runs once workers free up. Job a never ends
    by itself (100000 steps): it holds its workers through the checks, then is cancelled."""
    a = stack.client.submit(
        tiny_spec("a", fault_tolerance={"spares": 2}, train={"steps": 100000})
    ).id
    wait_phase(stack.client, a, ("Running",), 60)  # 4 of 8 workers busy
    b = stack.client.submit(tiny_spec("b", fault_tolerance={"spares": 4}, train={"steps": 4})).id
    c = stack.client.submit(tiny_spec("c", train={"steps": 4})).id  # 2 workers: fits now
    wait_phase(stack.client, c, ("Succeeded",), 120)
    jb = stack.client.job(b)
    assert jb.phase == "Pending" and jb.condition("Running").reason == "WaitingForCapacity"
    stack.client.cancel(a)
    wait_phase(stack.client, b, ("Succeeded",), 120)
    assert stack.client.job(c).started_at < stack.client.job(b).started_at


@pytest.mark.slow
def test_cancel_stops_every_trainer_and_frees_workers(stack):
    spec = tiny_spec("cancel-me", parallel={"dp": 2, "tp": 2}, train={"steps": 100000})
    jid = stack.client.submit(spec).id
    j = wait_until(lambda: (j := stack.client.job(jid)).step >= 2 and j, 120, "training to start")
    pids = [r.pid for r in j.mesh.ranks]
    assert len(pids) == 4 and all(pids)
    assert len(process_groups_alive(pids)) >= 4
    busy = {r.worker for r in j.mesh.ranks}
    accepted = stack.client.cancel(jid)
    assert accepted.cancel_requested
    done = wait_phase(stack.client, jid, ("Cancelled",), 20)
    assert_cancelled_only(done)
    wait_until(lambda: not process_groups_alive(pids), 15, f"trainer processes {pids} to be gone")
    wait_until(lambda: busy <= set(stack.idle_workers()), 15, "the job's workers to be idle")
    assert all(r.state == "stopped" for r in stack.client.job(jid).mesh.ranks)
    assert "TrainerStopped" in [e.reason for e in stack.client.events(jid)]
    with pytest.raises(Exception) as e:  # a second cancel is refused, not repeated
        stack.client.cancel(jid)
    assert getattr(e.value, "status", None) == 409


def test_pending_job_can_be_cancelled(stack):
    # every worker but one held, so the 8-worker job waits (admission refuses one that never fits)
    holder = stack.client.submit(
        tiny_spec("holder", fault_tolerance={"spares": 5}, train={"steps": 100000})
    ).id
    wait_phase(stack.client, holder, ("Running",), 60)
    jid = stack.client.submit(tiny_spec("later", parallel={"dp": 8}, train={"global_batch": 32})).id
    wait_until(
        lambda: stack.client.job(jid).condition("Running").reason == "WaitingForCapacity",
        10,
        "the job to wait for capacity",
    )
    stack.client.cancel(jid)
    j = wait_phase(stack.client, jid, ("Cancelled",), 10)
    assert_cancelled_only(j)
    assert j.generation == 0 and j.mesh.ranks == []
    stack.client.cancel(holder)
